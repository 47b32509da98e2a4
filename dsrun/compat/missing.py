"""DeepSpeed features that dsrun does not implement yet, and how they fail.

[Note: missing DeepSpeed names]
A script written for DeepSpeed that reaches a feature dsrun lacks must stop
with a message naming that feature, never with a bare AttributeError or
ModuleNotFoundError that reads like a broken install. Three kinds of names:
- modules (`deepspeed.inference`, `deepspeed.compression`, ...): `MISSING_MODULES`,
  served by `MissingModuleFinder`, which sits at the end of sys.meta_path
  and answers only for dsrun's own names that no file provides: importing
  one raises `FeatureNotImplementedError` (an ImportError).
- top-level attributes (`deepspeed.init_inference`, ...): `MISSING_ATTRS`,
  raised by dsrun's module `__getattr__` as `FeatureNotImplemented` (a
  NotImplementedError), so that `from dsrun import init_inference` carries
  the message too.
- engine methods (`engine.train_batch()`, ...): `MissingMethod`, which
  raises when called.
When a feature lands, delete its entry; a real module shadows its entry
anyway, because the finder is consulted after the normal ones.
"""
from __future__ import annotations

import sys

_RELEASE = "dsrun 0.1"


class FeatureNotImplemented(NotImplementedError):
    """A DeepSpeed API that this dsrun release does not implement."""


class FeatureNotImplementedError(ImportError):
    """Importing a DeepSpeed module that this dsrun release does not implement."""


def message(name: str, feature: str, instead: str | None) -> str:
    """The one-line explanation for a missing DeepSpeed name."""
    text = f"{name}: {feature} is not implemented in {_RELEASE}"
    return f"{text}; {instead}" if instead else text


# Module path relative to the package (a prefix covers its submodules) ->
# (feature, what to use instead or None).
MISSING_MODULES: dict[str, tuple[str, str | None]] = {
    "inference": ("DeepSpeed-Inference (init_inference, InferenceEngine)", "run the model with plain PyTorch"),
    "module_inject": ("kernel injection and automatic tensor parallelism", None),
    "compression": ("compression training (quantization, pruning)", None),
    "autotuning": ("the autotuner", None),
    "runtime.sequence_parallel": ("ALST (Ulysses for Hugging Face models: UlyssesSPAttentionHF, ...)",
                                  "wrap the attention in dsrun.sequence.layer.DistributedAttention"),
    "runtime.hybrid_engine": ("the hybrid engine (RLHF)", None),
    "runtime.domino": ("Domino tensor parallelism", None),
    "linear": ("LoRA-optimized linear layers", None),
    "ops.transformer": ("the fused transformer kernels (DeepSpeedTransformerLayer)",
                        "use the model's own layers"),
    "ops.sparse_attention": ("sparse attention kernels", None),
}

# Top-level names of `deepspeed` -> (feature, instead).
MISSING_ATTRS: dict[str, tuple[str, str | None]] = {
    "init_inference": MISSING_MODULES["inference"],
    "InferenceEngine": MISSING_MODULES["inference"],
    "DeepSpeedInferenceConfig": MISSING_MODULES["inference"],
    "default_inference_config": MISSING_MODULES["inference"],
    "DeepSpeedHybridEngine": MISSING_MODULES["runtime.hybrid_engine"],
    "DeepSpeedTransformerLayer": MISSING_MODULES["ops.transformer"],
    "DeepSpeedTransformerConfig": MISSING_MODULES["ops.transformer"],
    "replace_transformer_layer": MISSING_MODULES["module_inject"],
    "revert_transformer_layer": MISSING_MODULES["module_inject"],
    "OnDevice": ("OnDevice (building a model on the meta device)", "build the model under dsrun.zero.Init"),
}


def missing_module(relative: str) -> tuple[str, str | None] | None:
    """The MISSING_MODULES entry covering `relative` (e.g. "runtime.pipe.engine"), or None."""
    parts = relative.split(".")
    for end in range(len(parts), 0, -1):
        entry = MISSING_MODULES.get(".".join(parts[:end]))
        if entry is not None:
            return entry
    return None


def missing_attr(module_name: str, name: str) -> FeatureNotImplemented:
    """The exception for `module_name.name` from MISSING_ATTRS (KeyError if not listed)."""
    feature, instead = MISSING_ATTRS[name]
    return FeatureNotImplemented(message(f"{module_name}.{name}", feature, instead))


class MissingModuleFinder:
    """Raises FeatureNotImplementedError for `<package>.<missing module>`.

    Appended to sys.meta_path, so it only sees names that no file provides.
    A meta path finder needs only `find_spec`; not subclassing
    importlib.abc.MetaPathFinder spares every `import dsrun` (the launcher
    and each node's agent included) importing importlib.abc and
    importlib.resources.
    """

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname: str, path=None, target=None):
        prefix = self.package + "."
        if not fullname.startswith(prefix):
            return
        entry = missing_module(fullname[len(prefix):])
        if entry is None:
            return
        raise FeatureNotImplementedError(message(fullname, *entry), name=fullname)


def install(package: str) -> None:
    """Add a MissingModuleFinder for `package` to sys.meta_path (once)."""
    if not any(isinstance(f, MissingModuleFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(MissingModuleFinder(package))


class MissingMethod:
    """A class attribute that raises FeatureNotImplemented naming the feature when called.

    `train_batch = MissingMethod("pipeline parallelism", "use ...")` in a class body.
    """

    def __init__(self, feature: str, instead: str | None = None) -> None:
        self.feature, self.instead, self.name = feature, instead, "?"
        self.__doc__ = f"Not implemented: {feature}. Raises FeatureNotImplemented."

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        def method(*args, **kwargs):
            raise FeatureNotImplemented(message(f"engine.{self.name}()", self.feature, self.instead))
        method.__name__, method.__doc__ = self.name, self.__doc__
        return method

"""dsrun: a launcher and training runtime for large PyTorch models.

`import dsrun as deepspeed` is meant to run a DeepSpeed training script
unchanged; see README.md for what is supported. Public API:
`initialize`, `init_distributed`, `add_config_arguments`, `comm`
(DeepSpeed's `deepspeed.comm`), `Engine` (alias `DeepSpeedEngine`), `ops`
(DeepSpeed's optimizer names under `ops.adam`, `ops.lion`, `ops.adagrad`).
"""
import importlib

__version__ = "0.1.0"

# [Note: lazy public API]
# The launcher (`dsrun` head and the per-node agent, `python -m
# dsrun.launcher.agent`) imports this package but must not import torch,
# which costs seconds per process. The runtime API below is therefore loaded
# on first attribute access (PEP 562); `import dsrun as deepspeed` then
# `deepspeed.initialize(...)` and `from dsrun import initialize` work as before.
_LAZY_API = {
    "comm": ("dsrun.runtime.comm", None),
    "Topology": ("dsrun.runtime.dist", "Topology"),
    "init_distributed": ("dsrun.runtime.dist", "init_distributed"),
    "Engine": ("dsrun.runtime.engine", "Engine"),
    "DeepSpeedEngine": ("dsrun.runtime.engine", "Engine"),
    "add_config_arguments": ("dsrun.runtime.entry", "add_config_arguments"),
    "initialize": ("dsrun.runtime.entry", "initialize"),
    "zero": ("dsrun.runtime.zero", None),
    "ops": ("dsrun.ops", None),
    "estimate_zero_memory": ("dsrun.runtime.memory", "estimate_zero_memory"),
}


def __getattr__(name: str):
    try:
        module_name, attr = _LAZY_API[name]
    except KeyError:
        raise AttributeError(f"module 'dsrun' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_API})


__all__ = ["DeepSpeedEngine", "Engine", "Topology", "__version__", "add_config_arguments",
           "comm", "estimate_zero_memory", "init_distributed", "initialize", "ops", "zero"]

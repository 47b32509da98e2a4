"""dsrun: a launcher and training runtime for large PyTorch models.

`import dsrun as deepspeed` is meant to run a DeepSpeed training script
unchanged; see docs/migrating.md for what is supported. Public API:
`initialize`, `init_distributed`, `add_config_arguments`, `comm`
(DeepSpeed's `deepspeed.comm`), `Engine` (alias `DeepSpeedEngine`), `ops`
(DeepSpeed's optimizer names under `ops.adam`, `ops.lion`, `ops.adagrad`),
`accelerator.get_accelerator`, `checkpointing` (activation checkpointing),
`utils`, `zero`, `pipe` (pipeline parallelism: `PipelineModule`,
`LayerSpec`, `TiedLayerSpec`), `tp_model_init` (automatic tensor parallelism). DeepSpeed names dsrun lacks raise an error naming the
feature (dsrun/compat/missing.py).
"""
import importlib

from dsrun.compat import missing as _missing

__version__ = "0.1.0"

# [Note: lazy public API]
# The launcher (`dsrun` head and the per-node agent, `python -m
# dsrun.launcher.agent`) imports this package but must not import torch,
# which costs seconds per process. The runtime API below is therefore loaded
# on first attribute access (PEP 562); `import dsrun as deepspeed` then
# `deepspeed.initialize(...)` and `from dsrun import initialize` work as before.
_LAZY_API = {
    "comm": ("dsrun.comm", None),
    "Topology": ("dsrun.runtime.distributed.dist", "Topology"),
    "init_distributed": ("dsrun.runtime.comm.deepspeed_api", "init_distributed"),
    "Engine": ("dsrun.runtime.engine.engine", "Engine"),
    "DeepSpeedEngine": ("dsrun.runtime.engine.engine", "Engine"),
    "add_config_arguments": ("dsrun.runtime.engine.entry", "add_config_arguments"),
    "initialize": ("dsrun.runtime.engine.entry", "initialize"),
    "zero": ("dsrun.runtime.zero", None),
    "ops": ("dsrun.ops", None),
    "estimate_zero_memory": ("dsrun.runtime.memory.accounting", "estimate_zero_memory"),
    # DeepSpeed's other top-level names and subpackages (mirrored module paths).
    "accelerator": ("dsrun.accelerator", None),
    "get_accelerator": ("dsrun.accelerator", "get_accelerator"),
    "checkpointing": ("dsrun.runtime.activation_checkpointing.checkpointing", None),
    "utils": ("dsrun.utils", None),
    "runtime": ("dsrun.runtime", None),
    "checkpoint": ("dsrun.checkpoint", None),
    "log_dist": ("dsrun.utils", "log_dist"),
    "logger": ("dsrun.utils", "logger"),
    "DeepSpeedConfigError": ("dsrun.runtime.config", "ConfigError"),
    "moe": ("dsrun.moe", None),
    "pipe": ("dsrun.pipe", None),
    "elasticity": ("dsrun.elasticity", None),
    "PipelineModule": ("dsrun.runtime.parallel.pipe.module", "PipelineModule"),
    "PipelineEngine": ("dsrun.runtime.engine.pipeline_engine", "PipelineEngine"),
    "tp_model_init": ("dsrun.runtime.engine.tp_model_init", "tp_model_init"),
}
# See [Note: missing DeepSpeed names] in dsrun/compat/missing.py.
_missing.install(__name__)


def __getattr__(name: str):
    if name in _missing.MISSING_ATTRS:
        raise _missing.missing_attr("deepspeed", name)
    if not name.startswith("__") and _missing.missing_module(name) is not None:
        importlib.import_module(f"{__name__}.{name}")  # raises FeatureNotImplementedError
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


__all__ = ["DeepSpeedConfigError", "DeepSpeedEngine", "Engine", "Topology", "__version__", "accelerator",
           "add_config_arguments", "checkpoint", "checkpointing", "comm", "estimate_zero_memory",
           "get_accelerator", "init_distributed", "initialize", "log_dist", "logger", "ops", "pipe",
           "PipelineEngine", "PipelineModule", "runtime", "tp_model_init", "utils", "zero"]

"""The ds_config: typed, strict, with errors a user can act on.

Every key of DeepSpeed's JSON config that dsrun understands is a field of a
pydantic model (sections.py, schema.py), named exactly as in DeepSpeed, with
DeepSpeed's default and a description. `load_config` (loading.py) is the one
entry point:

    cfg = load_config("ds_config.json", world_size=2)   # or a dict, .yaml, DsConfig
    cfg.train_batch_size, cfg.zero_optimization.stage, ...

It reads the source, rejects unknown keys (naming the closest valid one),
translates pydantic's errors into one line per problem, resolves the batch
triple for the given world size, and finally rejects features this release
does not implement through one registry, `NOT_YET_SUPPORTED`. All problems
found are raised together as one `ConfigError`.

[Note: order of the checks]
The checks run in three phases, each collecting every problem it finds: (1)
reading the file, finding "auto" placeholders and applying DeepSpeed's forms
(see [Note: DeepSpeed's forms and foreign keys]), (2) pydantic validation of
all sections, which reports unknown keys, wrong types, bad values and the
checks inside one section (e.g. NVMe offload without a path), together with
the batch-triple arithmetic, which only needs the three batch keys (with an
enabled `elasticity` section the triple comes from dsrun.elasticity instead,
once every section is valid); the checks across sections (fp16 with bf16)
run in this phase once every section is valid; (3) `NOT_YET_SUPPORTED`, on
the valid config. A later phase runs only when the earlier ones found
nothing, so that no message is a consequence of another one; the one
exception is NOT_YET_SUPPORTED, which is also checked on the raw values when
phase 2 failed, so that a config's unsupported settings are reported in the
same round as its other problems.

The package, by concern (each module imports only those listed before it):
errors.py (ConfigError, ConfigWarning), sections.py (one model per section),
schema.py (DsConfig and the checks across sections), batch.py (the batch
triple), reading.py (JSON/YAML files), messages.py (pydantic's errors as
sentences), registries.py (NOT_YET_SUPPORTED, NO_EFFECT_YET), legacy.py
(DeepSpeed's "auto", legacy and foreign keys), loading.py (load_config).
"""
from __future__ import annotations

from dsrun.runtime.config import registries  # noqa: F401 - tests replace its NOT_YET_SUPPORTED
from dsrun.runtime.config.errors import (  # noqa: F401 - the package's names
    ConfigError,
    ConfigWarning,
)
from dsrun.runtime.config.sections import (  # noqa: F401 - the package's names
    ActivationCheckpointingConfig,
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    AioConfig,
    Bf16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    CompileConfig,
    Count,
    DataTypesConfig,
    DEEPSPEED_OPTIMIZERS,
    ElasticityConfig,
    Device,
    FlopsProfilerConfig,
    Fp16Config,
    Int,
    LAMB_OPTIMIZER,
    LION_OPTIMIZER,
    MonitorConfig,
    NonNegReal,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    OPTIMIZER_NAMES,
    OptimizerConfig,
    PosInt,
    PosReal,
    SCHEDULER_NAMES,
    SchedulerConfig,
    _Section,
    _unwrap,
    WandbConfig,
    ZERO_ONE_ADAM_OPTIMIZER,
    ZeroConfig,
)
from dsrun.runtime.config.schema import (  # noqa: F401 - the package's names
    _DEEPSPEED_ONLY_KEYS,
    DsConfig,
)
from dsrun.runtime.config.batch import (  # noqa: F401 - the package's names
    BATCH_KEYS,
    resolve_batch_triple,
)
from dsrun.runtime.config.reading import (  # noqa: F401 - the package's names
    _read_file,
)
from dsrun.runtime.config.messages import (  # noqa: F401 - the package's names
    _model_of,
)
from dsrun.runtime.config.registries import (  # noqa: F401 - the package's names
    NO_EFFECT_YET,
    NOT_YET_SUPPORTED,
    Unsupported,
)
from dsrun.runtime.config.legacy import (  # noqa: F401 - the package's names
    STRICT_ENV,
)
from dsrun.runtime.config.loading import (  # noqa: F401 - the package's names
    load_config,
    offload_param_of,
    pipeline_of,
    sequence_parallel_size_of,
    tensor_parallel_of,
)

__all__ = [
    "ConfigError",
    "ConfigWarning",
    "DsConfig",
    "NO_EFFECT_YET",
    "NOT_YET_SUPPORTED",
    "Unsupported",
    "load_config",
    "resolve_batch_triple",
]

"""`compute_elastic_config`: DeepSpeed's `deepspeed.elasticity.compute_elastic_config`."""
from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

import dsrun
from dsrun.elasticity.batch import micro_batch_for, search
from dsrun.elasticity.errors import ElasticityConfigError, ElasticityError
from dsrun.runtime.config.legacy import _drop_foreign_keys
from dsrun.runtime.config.messages import _translate
from dsrun.runtime.config.schema import DsConfig
from dsrun.runtime.config.sections import ElasticityConfig

# The first DeepSpeed release with elasticity; an older target cannot run an elastic job.
MINIMUM_DEEPSPEED_VERSION = "0.3.8"


def elasticity_enabled(ds_config: Mapping | DsConfig) -> bool:
    """True when the config has an `elasticity` section with `"enabled": true`."""
    if isinstance(ds_config, DsConfig):
        return ds_config.elasticity.enabled
    section = ds_config.get("elasticity")
    return isinstance(section, Mapping) and section.get("enabled") is True


def compute_elastic_config(ds_config: Mapping | DsConfig, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple:
    """The global batch size of an elastic job and the world sizes that can run it.

    DeepSpeed's API (deepspeed/elasticity/elasticity.py), with its results
    for the same config: a resource scheduler calls it to learn which GPU
    counts it may give the job; the engine calls it (through
    dsrun.elasticity.batch) with its data-parallel size to get its
    micro-batch, the gradient accumulation being
    batch / (micro-batch x world size). See [Note: the elastic batch search]
    in algorithm.py.

    Args:
        ds_config: the whole ds_config (a dict as given to initialize(), or
            a DsConfig); only its `elasticity` section is read. Unknown keys
            in the section warn and are ignored, as in load_config.
        target_deepspeed_version: the version of the runtime that will run
            the job: dsrun's own (`dsrun.__version__`, which is
            `deepspeed.__version__` under `import dsrun as deepspeed`) or a
            DeepSpeed version, which must be 0.3.8 or later.
        world_size: the job's world size (the data-parallel size when the
            model is split over ranks); 0 = not known. Version 0.2 then
            reads the WORLD_SIZE environment variable.
        return_microbatch: also return a micro-batch when world_size is 0
            (version 0.2 only: the one for WORLD_SIZE).

    Returns:
        (batch size, valid world sizes) where batch size is the global
        batch in samples and valid world sizes are ascending; with
        world_size > 0, or return_microbatch, a third item: the micro-batch
        per rank (the largest allowed one dividing batch // world_size; for
        return_microbatch with version 0.2, version 0.2's own choice, or
        None when none divides).

    Raises:
        ValueError: ds_config is not a mapping, world_size is negative, or
            return_microbatch is asked of version 0.1 without a world_size
            (DeepSpeed divides by zero there).
        ElasticityConfigError: the section is missing, disabled or invalid
            (one line per problem), or version 0.2 has neither world_size nor
            a numeric WORLD_SIZE.
        ElasticityError: the target version cannot run elasticity, or no
            allowed micro-batch divides the per-rank batch.
        ElasticityIncompatibleWorldSize: world_size is not a valid world size.
    """
    elasticity = _section(ds_config)
    _check_target_version(target_deepspeed_version)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 0:
        raise ValueError(f"world_size must be an integer >= 0 (0 = unknown), got {world_size!r}")
    num_gpus = world_size or (_world_size_from_env() if elasticity.version == 0.2 else 0)
    batch, valid, v02_micro = search(elasticity, num_gpus)
    if world_size > 0:
        return batch, valid, micro_batch_for(batch, valid, world_size, elasticity.micro_batch_sizes)
    if not return_microbatch:
        return batch, valid
    if elasticity.version == 0.1:
        raise ValueError("return_microbatch with elasticity version 0.1 needs the world size: pass "
                         "world_size > 0 (the micro-batch depends on it)")
    return batch, valid, v02_micro


def _section(ds_config: Mapping | DsConfig) -> ElasticityConfig:
    """The validated, enabled `elasticity` section of a config."""
    if isinstance(ds_config, DsConfig):
        section: Any = ds_config.elasticity.model_dump(exclude_unset=True)
    elif isinstance(ds_config, Mapping):
        if "elasticity" not in ds_config:
            raise ElasticityConfigError("the config has no 'elasticity' section; add one with "
                                        "\"enabled\": true, max_train_batch_size and micro_batch_sizes")
        section = ds_config["elasticity"]
    else:  # ValueError, not TypeError: what DeepSpeed raises here
        raise ValueError(f"ds_config must be a dict (or DsConfig), got {type(ds_config).__name__}: "  # noqa: TRY004
                         f"{ds_config!r}")
    if not isinstance(section, Mapping):
        raise ElasticityConfigError(f"elasticity: expected an object, got {section!r}")
    if section.get("enabled") is not True:
        raise ElasticityConfigError("elasticity is disabled; set elasticity.enabled to true for an elastic job")
    section = copy.deepcopy(dict(section))
    _drop_foreign_keys(section, ElasticityConfig, "elasticity", strict=False, source="ds_config")
    try:
        return ElasticityConfig.model_validate(section)
    except ValidationError as exc:
        raise ElasticityConfigError("\n".join(_translate({**e, "loc": ("elasticity", *e["loc"])})
                                              for e in exc.errors())) from None


def _check_target_version(target: str) -> None:
    """Raise ElasticityError unless `target` is dsrun's version or DeepSpeed >= 0.3.8."""
    if target == dsrun.__version__:
        return
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(target))
    if found is None:
        raise ElasticityError(f"target_deepspeed_version {target!r} is not a version (expected "
                              f"major.minor[.patch], e.g. dsrun.__version__)")
    version = tuple(int(part or 0) for part in found.groups())
    minimum = tuple(int(part) for part in MINIMUM_DEEPSPEED_VERSION.split("."))
    if version < minimum:
        raise ElasticityError(f"target DeepSpeed version {target} has no elasticity (it came in "
                              f"{MINIMUM_DEEPSPEED_VERSION}); target {MINIMUM_DEEPSPEED_VERSION} or later, "
                              f"or dsrun {dsrun.__version__}")


def _world_size_from_env() -> int:
    value = os.environ.get("WORLD_SIZE")
    if value is None or not value.isdigit():
        raise ElasticityConfigError(f"elasticity version 0.2 needs the world size: pass world_size= or set "
                                    f"WORLD_SIZE (it is {value!r})")
    return int(value)

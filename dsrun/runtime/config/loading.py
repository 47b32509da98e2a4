"""`load_config`, the one entry point (see [Note: order of the checks] in __init__.py)."""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

from pydantic import (
    TypeAdapter,
    ValidationError,
)

from dsrun.elasticity.batch import elastic_batch_triple
from dsrun.elasticity.errors import ElasticityError
from dsrun.env import STRICT_CONFIG
from dsrun.runtime.config.batch import BATCH_KEYS, resolve_batch_triple
from dsrun.runtime.config.errors import ConfigError, ConfigWarning
from dsrun.runtime.config.legacy import _auto_problem, _deepspeed_forms, _drop_foreign_keys, _pop_auto
from dsrun.runtime.config.messages import _translate
from dsrun.runtime.config.reading import _read_file
from dsrun.runtime.config.registries import _unsupported, _unsupported_raw, _warn_no_effect
from dsrun.runtime.config.schema import _BatchTriple, DsConfig, _set_values
from dsrun.runtime.config.sections import _fill, OffloadParamConfig, PipelineConfig, PosInt, TensorParallelConfig

_SEQUENCE_SIZE = TypeAdapter(PosInt)


def offload_param_of(source: Mapping | str | os.PathLike | DsConfig) -> OffloadParamConfig:
    """`zero_optimization.offload_param` of a ds_config, validated on its own.

    zero.Init reads it while the model is built, when a Hugging Face config
    may still hold "auto" placeholders elsewhere that `load_config` rejects.
    DeepSpeed's old `cpu_offload_param: true` (with
    `cpu_offload_use_pin_memory`) reads as device cpu. Raises ConfigError
    when the file cannot be read or the section is invalid.
    """
    if isinstance(source, DsConfig):
        return source.zero_optimization.offload_param
    name = "dict" if isinstance(source, Mapping) else str(source)
    raw = source if isinstance(source, Mapping) else _read_file(Path(source))
    zero = raw.get("zero_optimization") if isinstance(raw, Mapping) else None
    if not isinstance(zero, Mapping):
        return OffloadParamConfig()
    section = zero.get("offload_param")
    if section is None and zero.get("cpu_offload_param") is True:
        section = {"device": "cpu", "pin_memory": bool(zero.get("cpu_offload_use_pin_memory", False))}
    try:
        return OffloadParamConfig.model_validate(section or {})
    except ValidationError as exc:
        raise ConfigError(*(f"zero_optimization.offload_param.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                            for e in exc.errors()), source=name) from None


def _section_of(source: Mapping | str | os.PathLike, key: str, section_type):
    """The `key` section of a raw ds_config (dict or file), validated on its
    own as `section_type`; the defaults when absent. Raises ConfigError when
    the file cannot be read or the section is invalid."""
    name = "dict" if isinstance(source, Mapping) else str(source)
    raw = source if isinstance(source, Mapping) else _read_file(Path(source))
    section = raw.get(key) if isinstance(raw, Mapping) else None
    try:
        return section_type.model_validate(section if isinstance(section, Mapping) else {})
    except ValidationError as exc:
        raise ConfigError(*(f"{key}.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                            for e in exc.errors()), source=name) from None


def tensor_parallel_of(source: Mapping | str | os.PathLike | DsConfig) -> TensorParallelConfig:
    """The `tensor_parallel` section of a ds_config, validated on its own.

    `initialize()` needs the tensor-parallel degree before `load_config`,
    whose batch triple counts only the data-parallel ranks. Raises
    ConfigError when the file cannot be read or the section is invalid.
    """
    if isinstance(source, DsConfig):
        return source.tensor_parallel
    return _section_of(source, "tensor_parallel", TensorParallelConfig)


def pipeline_of(source: Mapping | str | os.PathLike | DsConfig) -> PipelineConfig:
    """The `pipeline` section of a ds_config, validated on its own: its
    `stages` is the pipeline degree that `init_distributed(config=...)`
    builds the mesh with, before the model and before `load_config`.
    Raises ConfigError as tensor_parallel_of does.
    """
    if isinstance(source, DsConfig):
        return source.pipeline
    return _section_of(source, "pipeline", PipelineConfig)


def sequence_parallel_size_of(source: Mapping | str | os.PathLike | DsConfig) -> int:
    """The `sequence_parallel_size` of a ds_config, validated on its own
    (1 when absent): like tensor_parallel_of, initialize() needs it before
    `load_config`, whose batch triple counts only the data-parallel ranks.
    Raises ConfigError when the file cannot be read or the value is not an
    integer >= 1.
    """
    if isinstance(source, DsConfig):
        return source.sequence_parallel_size
    name = "dict" if isinstance(source, Mapping) else str(source)
    raw = source if isinstance(source, Mapping) else _read_file(Path(source))
    value = raw.get("sequence_parallel_size", 1) if isinstance(raw, Mapping) else 1
    try:
        return _SEQUENCE_SIZE.validate_python(value)
    except ValidationError as exc:
        raise ConfigError(*(f"sequence_parallel_size: {e['msg']}" for e in exc.errors()), source=name) from None


def load_config(source: Mapping | str | os.PathLike | DsConfig, world_size: int | None = None,
                strict: bool | None = None) -> DsConfig:
    """Read, validate and resolve a ds_config.

    Args:
        source: a dict (as for DeepSpeed's `config=`), a path to a .json,
            .yaml or .yml file (other suffixes are read as JSON), or a
            DsConfig (validated again from the keys set in it, so the
            batch triple is inferred again for `world_size`).
        world_size: data-parallel world size for the batch triple; None
            reads the WORLD_SIZE environment variable, or 1 when it is unset.
        strict: every unknown key is an error; None reads DSRUN_STRICT_CONFIG
            ("1" = strict). Otherwise only a likely typo of a known key is an
            error and other unknown keys warn (ConfigWarning), naming them.

    Returns:
        A DsConfig whose train_batch_size, train_micro_batch_size_per_gpu and
        gradient_accumulation_steps are ints.

    Raises:
        ConfigError: the file is missing or does not parse, or the config
            has problems; every problem found is listed, one per line (see
            [Note: order of the checks]).
        ValueError: world_size is not a positive integer.
    """
    if world_size is None:
        env = os.environ.get("WORLD_SIZE", "1")
        if not env.strip().isdigit():
            raise ValueError(f"WORLD_SIZE={env!r} is not a positive integer; pass world_size= explicitly")
        world_size = int(env)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")

    if isinstance(source, DsConfig):
        name = "DsConfig"
        raw = _set_values(source)
    elif isinstance(source, Mapping):
        name, raw = "dict", source
    elif isinstance(source, (str, os.PathLike)):
        name = str(source)
        raw = _read_file(Path(source))
    else:
        raise ConfigError(f"a config must be a dict, a file path or a DsConfig, got {type(source).__name__}")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the config must be a JSON object / YAML mapping at the top level, got "
                          f"{type(raw).__name__}", source=name)

    try:
        data = json.loads(json.dumps(raw, default=str))  # a private deep copy, as plain JSON data
    except RecursionError:
        raise ConfigError("nested more than a few hundred levels deep; a ds_config has at most 3 levels "
                          "of sections", source=name) from None
    autos = _pop_auto(data, "")
    problems = [_auto_problem(p) for p in autos]
    if strict is None:
        strict = STRICT_CONFIG.read()
    _deepspeed_forms(data)
    _drop_foreign_keys(data, DsConfig, "", strict, name)
    cfg = None
    try:
        cfg = DsConfig.model_validate(data)
    except ValidationError as exc:
        problems.extend(_translate(e) for e in exc.errors())
    if isinstance(data.get("elasticity"), dict) and data["elasticity"].get("enabled") is True:
        triple = [] if cfg is None else _elastic_batch(cfg, data, world_size, name)
    else:
        triple = _batch_problems(data, world_size, skip=any(p in BATCH_KEYS for p in autos))
    if isinstance(triple, list):
        problems.extend(triple)
    if problems or cfg is None or not isinstance(triple, tuple):
        raise ConfigError(*problems, *_unsupported_raw(data), source=name)

    problems = _unsupported(cfg) + _world_problems(cfg, world_size)
    if problems:
        raise ConfigError(*problems, source=name)
    _warn_no_effect(cfg, name)
    for key, value in zip(BATCH_KEYS, triple):
        _fill(cfg, key, value)
    cfg._world_size = world_size
    return cfg


def _world_problems(cfg: DsConfig, world_size: int) -> list[str]:
    """Settings that must fit the (data-parallel) world size. hpZ splits
    ZeRO's group, data x sequence ranks under sequence parallelism (the
    node layout is checked when the strategy is built: zero/stage3.py
    `_hpz_group`)."""
    hpz = cfg.zero_optimization.zero_hpz_partition_size
    sequence = cfg.sequence_parallel_size
    if hpz > 1 and (world_size * sequence) % hpz:
        group = f"world size {world_size}" if sequence == 1 else \
            f"ZeRO group of {world_size} data x {sequence} sequence ranks"
        return [f"zero_optimization.zero_hpz_partition_size={hpz} does not divide the {group}; set it to "
                "the number of ranks per node (or a divisor of it), or 1"]
    return []


def _elastic_batch(cfg: DsConfig, data: dict, world_size: int, source: str) -> tuple[int, int, int] | list[str]:
    """The batch triple from an enabled `elasticity` section (dsrun.elasticity), or its problem."""
    given = [k for k in BATCH_KEYS if k in data]
    try:
        triple = elastic_batch_triple(cfg, world_size, given)
    except ElasticityError as exc:
        return [str(exc)]
    if given:  # allowed by elasticity.ignore_non_elastic_batch_info
        warnings.warn(f"{source}: {', '.join(f'{k}={data[k]}' for k in given)} overridden by elasticity: "
                      f"{', '.join(f'{k}={v}' for k, v in zip(BATCH_KEYS, triple))} for world size {world_size}",
                      ConfigWarning, stacklevel=4)
    return triple


def _batch_problems(data: dict, world_size: int, skip: bool) -> tuple[int, int, int] | list[str]:
    """Resolve the triple from the raw keys alone (see [Note: order of the checks]).

    Returns the resolved triple, or a list of problems (empty when the keys
    themselves are invalid or "auto": those are reported elsewhere).
    """
    if skip:
        return []
    try:
        batch = _BatchTriple.model_validate({k: data[k] for k in BATCH_KEYS if k in data})
    except ValidationError:
        return []
    try:
        return resolve_batch_triple(batch.train_batch_size, batch.train_micro_batch_size_per_gpu,
                                    batch.gradient_accumulation_steps, world_size)
    except ConfigError as exc:
        return exc.problems

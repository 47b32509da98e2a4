"""The two registries of what dsrun does not do yet: settings it rejects
(`NOT_YET_SUPPORTED`) and keys it accepts without acting on them (`NO_EFFECT_YET`).

Each NOT_YET_SUPPORTED entry rejects one setting; delete the entry when the
feature lands.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import (
    BaseModel,
)

from dsrun.runtime.config.errors import ConfigWarning, _RELEASE
from dsrun.runtime.config.schema import DsConfig, _show

@dataclass(frozen=True)
class Unsupported:
    """One setting this release rejects.

    Attributes:
        path: dotted key path of the setting in the config.
        applies: predicate on the validated value; true means rejected.
        feature: what is not implemented, as a noun phrase.
        fix: how to get a supported config ("set it to 0").
    """

    path: str
    applies: Callable[[Any], bool]
    feature: str
    fix: str = "set it to false"


def _on(value: Any) -> bool:
    return bool(value)


# [Note: deliberately refused]
# `fp16.fp16_master_weights_and_grads` keeps the master weights and the
# gradients in fp16 (DeepSpeed allows it only with ZeRO-2, CPU offload and
# its CPU Adam). dsrun refuses it on purpose: Adam's update on fp16 masters
# loses every step smaller than the weight's fp16 spacing (2^-10 relative),
# so small learning rates silently stop training, and the memory it saves
# (2 bytes per parameter of host memory) is what bf16 training with fp32
# masters, or optimizer offload to NVMe, gives without that loss.
NOT_YET_SUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("fp16.fp16_master_weights_and_grads", _on,
                "fp16 master weights (refused on purpose: updates below fp16 precision are lost)",
                "set it to false; use bf16, or offload the optimizer to save host memory"),
    Unsupported("compile.deepcompile", _on,
                "DeepCompile (DeepSpeed's compiler passes for ZeRO)",
                "set it to false; engine.compile() compiles the model with torch.compile at every ZeRO stage"),
    Unsupported("compile.autoep_non_moe", _on, "AutoEP regional compilation (there is no AutoEP)",
                "set it to false; engine.compile() compiles the whole model (per unit at ZeRO stage 3)"),
    Unsupported("data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled", _on,
                "a learning rate schedule in layer-tokens for random-LTD (nor does DeepSpeed)",
                "set it to false; use an LR schedule in optimizer steps"),
)


def _unsupported(cfg: DsConfig) -> list[str]:
    problems = []
    for entry in NOT_YET_SUPPORTED:
        value: Any = cfg
        for part in entry.path.split("."):
            value = getattr(value, part, None)  # None when a parent section is absent
        if value is not None and entry.applies(value):
            problems.append(f"{entry.path}={_show(value)}: {_RELEASE} does not support {entry.feature} "
                            f"yet; remove it or {entry.fix}")
    return problems


# Settings that are accepted, so that DeepSpeed configs load, but that this
# release does not act on. Each maps to the value dsrun behaves as (it always
# overlaps, reduce-scatters, all-gathers, uses contiguous buffers, tolerates
# unused parameters, frees gathered stage-3 weights before backward and takes
# any optimizer; the rest are knobs of parts not built yet). load_config
# warns, naming each one the config sets to anything else, instead of
# ignoring it silently; delete an entry when its setting takes effect.
# tests/config/test_keys_take_effect.py fails on a key that is read by
# nothing and listed neither here nor in NOT_YET_SUPPORTED.
NO_EFFECT_YET: dict[str, Any] = {
    "zero_optimization.overlap_comm": True,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,  # save_16bit_model always gathers
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.load_from_fp32_weights": True,  # checkpoints always restore the fp32 masters
    "zero_optimization.memory_efficient_linear": True,
    "zero_allow_untested_optimizer": True,
    "zero_optimization.mics_hierarchical_params_gather": False,  # one flat all-gather over the shard group
    "pipeline.pipe_partitioned": True,  # sent whole to the same model rank of the next stage, not split yet
    "pipeline.grad_partitioned": True,
    "pipeline.use_reentrant": True,  # the PipelineModule's activation_checkpoint_func decides
    "activation_checkpointing.contiguous_memory_optimization": False,  # no copy into one buffer
    "activation_checkpointing.number_checkpoints": None,
    "checkpoint.load_universal": True,
    "comms_logger.debug": False,  # callers of collectives are not recorded
    "zero_optimization.offload_optimizer.fast_init": False,  # swap files are preallocated in one call
    "zero_optimization.offload_param.buffer_size": 100_000_000,  # NVMe reads whole unit partitions
    "zero_optimization.offload_param.max_in_cpu": 1_000_000_000,  # no host cache of NVMe partitions
    "elasticity.min_time": 0,  # a hint for resource schedulers; DeepSpeed's runtime does not read it either
    "data_efficiency.data_sampling.num_workers": 0,  # the curriculum loader reads samples in the rank's process
    "data_efficiency.data_sampling.pin_memory": False,
    "data_efficiency.data_sampling.curriculum_learning.data_cluster_path": None,  # clusters live in memory
}


def _user_value(cfg: DsConfig, path: str) -> tuple[bool, Any]:
    """(True, value) when the config file/dict itself set the dotted `path`."""
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, BaseModel) or part not in node.model_fields_set:
            return False, None
        node = getattr(node, part)
    return True, node


def _warn_no_effect(cfg: DsConfig, source: str) -> None:
    keys = []
    for path, acts_as in NO_EFFECT_YET.items():
        is_set, value = _user_value(cfg, path)
        if is_set and value != acts_as:
            keys.append(f"{path}={_show(value)}")
    if keys:
        warnings.warn(f"{source}: {_RELEASE} accepts but does not act on {', '.join(keys)}; "
                      "the run goes on as if they were left out", ConfigWarning, stacklevel=3)


def _unsupported_raw(data: dict) -> list[str]:
    """NOT_YET_SUPPORTED checked on raw values, for a config that failed
    validation (see [Note: order of the checks]); values that are not of
    the field's type are skipped (validation reported them)."""
    problems = []
    for entry in NOT_YET_SUPPORTED:
        value: Any = data
        for part in entry.path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        try:
            rejected = value is not None and not isinstance(value, (dict, list)) and entry.applies(value)
        except (TypeError, ValueError):
            continue
        if rejected:
            problems.append(f"{entry.path}={_show(value)}: {_RELEASE} does not support {entry.feature} "
                            f"yet; remove it or {entry.fix}")
    return problems

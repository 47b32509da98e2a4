"""ZeRO (Rajbhandari et al., SC20): partitioned optimizer states (stage 1),
gradients (stage 2) and parameters (stage 3), with bf16/fp16 mixed precision.

`build_zero_strategy` is what the engine calls for any stage > 0 or any
16-bit precision; the stages are GradientStrategy implementations
(see dsrun/runtime/strategy/data_parallel.py).
"""
from __future__ import annotations

import torch

from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.offload import build_optimizer_tier, build_param_tier
from dsrun.runtime.optim.precision import PrecisionPolicy
from dsrun.runtime.config import ConfigError
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.zero.experts import check_expert_support
from dsrun.runtime.zero.groups import ZeroGroups
from dsrun.runtime.zero.params import record_of
from dsrun.runtime.zero.api import (GatheredParameters, safe_get_full_fp32_param, safe_get_full_grad,
                                    safe_get_full_optimizer_state)
from dsrun.runtime.zero.init import Init
from dsrun.runtime.zero.module_hints import register_external_parameter, unregister_external_parameter
from dsrun.runtime.zero.policies import GatherPolicy, ZeroPPPolicy
from dsrun.runtime.zero.stage12 import PartitionedOptimizerStrategy
from dsrun.runtime.zero.stage3 import PartitionedParamStrategy
from dsrun.runtime.zero.strategy import ZeroStrategy
from dsrun.runtime.zero.tiling import TiledLinear

__all__ = ["Init", "GatheredParameters", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "register_external_parameter", "unregister_external_parameter",
           "build_zero_strategy", "ZeroStrategy", "TiledLinear",
           "PartitionedOptimizerStrategy", "PartitionedParamStrategy", "GatherPolicy", "ZeroPPPolicy"]


def _check_no_init_shards(module: torch.nn.Module, shard_size: int) -> None:
    """MiCS shards over blocks of ranks, while zero.Init partitions over its
    data-parallel group (every rank) and broadcasts initial values within
    it only; raises ConfigError when `module` holds a parameter built under
    zero.Init (checked on every rank alike: they build the same model)."""
    inits = [n for n, p in module.named_parameters()
             if (rec := record_of(p)) is not None and rec.init_shard is not None]
    if inits:
        raise ConfigError(f"zero_optimization.mics_shard_size={shard_size}: parameter {inits[0]} was built "
                          "under zero.Init, which partitions over every rank, not over MiCS's blocks; build "
                          "the model without zero.Init, or set mics_shard_size to -1")


def build_zero_strategy(cfg, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        topology: Topology, group=None, *, mesh: ParallelMesh,
                        data_axis: str = "data") -> ZeroStrategy:
    """The strategy for `cfg.zero_optimization.stage` and `cfg`'s precision.

    Stage 0 with bf16/fp16 uses the stage-1/2 machinery over the (nobody,
    world) group pair (see groups.py). `group`: the data-parallel process
    group to partition and average over (None: every rank; the mesh's data
    axis under tensor parallelism or a pipeline: a stage's ranks of the
    same pipeline stage). Raises ValueError for an unknown stage.

    `zero_optimization.mics_shard_size` > 0 (MiCS) shards stages 1-3 within
    blocks of that many ranks of `mesh`'s `data_axis` group (the group
    `group` is: "data", or "sequence_data" under sequence parallelism) and
    replicates across the blocks
    (ZeroGroups.mics; ConfigError when it does not divide that group).
    Stage 0 shards nothing: there it changes nothing,
    as in DeepSpeed, which builds MiCS for stage 3 only.

    Mixture-of-Experts parameters are partitioned over their
    expert-data-parallel group (see [Note: expert partitions] in
    experts.py); MiCS, ZeRO++ hpZ and qgZ and offload are refused with them
    at initialize (runtime/parallel/combinations.py).
    """
    zero = cfg.zero_optimization
    check_expert_support(module)
    precision = PrecisionPolicy.from_config(cfg)
    tier = build_optimizer_tier(cfg, topology)
    mics = None
    if zero.mics_shard_size > 0 and zero.stage > 0:
        _check_no_init_shards(module, zero.mics_shard_size)
        mics = ZeroGroups.mics(zero.mics_shard_size, mesh, data_axis)
    if zero.stage in (0, 1, 2):
        return PartitionedOptimizerStrategy(
            module, optimizer, topology, precision, zero.stage, reduce_bucket_size=zero.reduce_bucket_size,
            allgather_bucket_size=zero.allgather_bucket_size, sub_group_size=zero.sub_group_size,
            group=group, optimizer_tier=tier, groups=mics, mesh=mesh)
    if zero.stage == 3:
        return PartitionedParamStrategy(
            module, optimizer, topology, precision, GatherPolicy.from_config(cfg), ZeroPPPolicy.from_config(cfg),
            reduce_bucket_size=zero.reduce_bucket_size, sub_group_size=zero.sub_group_size, group=group,
            optimizer_tier=tier, param_tier=build_param_tier(cfg, topology), groups=mics,
            mesh=mesh, data_axis=data_axis)
    raise ValueError(f"zero_optimization.stage={zero.stage} is not available")

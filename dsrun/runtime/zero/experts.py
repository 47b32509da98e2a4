"""Mixture-of-Experts parameters under ZeRO: which ranks partition, reduce
and count the gradients of an expert parameter.

[Note: expert partitions]
An expert parameter (`allreduce = False`, `group_name = "ep_size_<P>"`; see
dsrun/runtime/parallel/expert/groups.py) is held by the ranks of its
expert-data-parallel group only (the data ranks with the same expert-parallel
rank); the other ranks of the data axis hold other experts under the same
name. ZeRO therefore keeps expert parameters in FlatParamSets of their own,
one per (optimizer group, expert group name) at stages 0-2 and one per gather
unit at stage 3, laid out over the expert-data-parallel group instead of the
whole data axis:

- stages 1-3: shard group = the expert-data-parallel group, no replicas
  (the dense parameters are sharded over the whole data axis);
- stage 0 in 16-bit: shard group = this rank alone, replicate group = the
  expert-data-parallel group (the dense ones replicate over the data axis).

Their gradients are summed over that group and divided by the data-parallel
size D, not by its own size: each copy of an expert has already received
the gradients of the tokens of its whole expert-parallel group through the
all-to-all's backward, so the sum over the expert-data-parallel group
covers every data rank once and /D makes it the data-parallel average.
This is DeepSpeed's divisor too (0.19: engine._reduce_expert_gradients and
stage_1_and_2's average_tensor both divide expert gradients by the
data-parallel world size), so a DeepSpeed script trains alike.

The global gradient norm counts each expert shard once: the squares of an
expert group's shards are summed over its expert-data-parallel group (the
shard group) and then over its expert-parallel group (the ranks holding
the other experts), and added to the dense ones' (DeepSpeed 0.19 averages
the expert groups' norms over the expert-data-parallel group instead,
microsoft/DeepSpeed#8475, so its clipping sees a different norm for every
ep_size). An inf/nan in any expert gradient thus reaches every data rank's
norm, and fp16 loss scaling skips the step on all of them alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsrun.runtime import comm
from dsrun.runtime.config import ConfigError
from dsrun.runtime.parallel.expert.groups import expert_group_name_of, expert_groups, is_expert_param
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.zero.groups import RankGroup, ZeroGroups
from dsrun.runtime.zero.params import record_of


@dataclass(frozen=True)
class ExpertSetGroups:
    """The groups of the FlatParamSets holding one expert group's parameters.

    name: "ep_size_<P>". groups: the (shard, replicate) pair their
    gradients are reduced over and their layout is partitioned over (see
    [Note: expert partitions]). average_over: D, what the gradient sum is
    divided by. expert_parallel: the ranks holding the other experts (the
    norm's second sum).
    """

    name: str
    groups: ZeroGroups
    average_over: int
    expert_parallel: RankGroup


def _rank_group(mesh_group) -> RankGroup:
    if mesh_group.size == 1:
        return RankGroup.alone()
    return RankGroup(mesh_group.group, mesh_group.rank, mesh_group.size)


def expert_set_groups(name: str, sharded: bool, data_size: int, mesh: ParallelMesh) -> ExpertSetGroups:
    """The groups of expert group `name` on `mesh` (the job's) when the
    dense parameters are sharded over the data axis (`sharded`: stages 1-3)
    or replicated on it (stage 0 in 16-bit); `data_size` is D. Collective
    over every rank the first time for a name (see expert/groups.py).

    Raises:
        ConfigError: the expert groups' data axis is not the one ZeRO
            averages over (their sizes differ).
    """
    experts = expert_groups(name, mesh)
    if experts.data_size != data_size:
        raise ConfigError(f"MoE: the expert groups {name} live on a data axis of {experts.data_size} ranks while "
                          f"ZeRO averages over {data_size}; build the MoE layers on the same mesh the engine "
                          "trains on")
    edp = _rank_group(experts.expert_data_parallel)
    pair = ZeroGroups(edp, RankGroup.alone()) if sharded else ZeroGroups(RankGroup.alone(), edp)
    return ExpertSetGroups(name, pair, data_size, _rank_group(experts.expert_parallel))


def expert_name(param: torch.nn.Parameter) -> str | None:
    """The expert group name of an expert parameter, None for a dense one."""
    return expert_group_name_of(param) if is_expert_param(param) else None


def check_expert_support(module: torch.nn.Module) -> bool:
    """Whether `module` holds expert parameters. The ZeRO features whose
    groups are fixed to the whole data axis (MiCS, hpZ, qgZ, offload) are
    refused with experts before this, by the combination table
    (runtime/parallel/combinations.py).

    Raises:
        ConfigError: an expert parameter built under zero.Init (partitioned
            over every rank, not its expert-data-parallel group).
    """
    experts = [(n, p) for n, p in module.named_parameters() if is_expert_param(p)]
    if not experts:
        return False
    for n, p in experts:
        rec = record_of(p)
        if rec is not None and rec.init_shard is not None:
            raise ConfigError(f"expert parameter {n} was built under zero.Init, which partitions over every "
                              "rank; build the MoE layers outside zero.Init")
    return True


def add_expert_sq_norms(sq_by_name: dict[str, torch.Tensor], sets: dict[str, ExpertSetGroups]) -> torch.Tensor:
    """The squared gradient norm of every expert group, each shard counted
    once (see [Note: expert partitions]): each name's local sum of squares
    (`sq_by_name`, (1,) fp32) is all-reduced over its shard group, then over
    its expert-parallel group, in name order (collective over both on every
    rank; every rank has the same names). Returns their total, (1,) fp32."""
    total = None
    for name in sorted(sets):
        sq = sq_by_name[name]
        groups = sets[name]
        if groups.groups.shard.size > 1:
            comm.all_reduce(sq, group=groups.groups.shard.group)
        if groups.expert_parallel.size > 1:
            comm.all_reduce(sq, group=groups.expert_parallel.group)
        total = sq if total is None else total + sq
    return total

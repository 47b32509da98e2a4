"""Adopting a Megatron-style model-parallel unit (`initialize(mpu=...)`).

[Note: adopting an mpu]
Megatron-DeepSpeed and GPT-NeoX pass `deepspeed.initialize` their own
model-parallel unit (Megatron's `parallel_state`), whose process groups
their layers already use; DeepSpeed then partitions ZeRO over the mpu's
data-parallel group and reduces the gradient norm over its model-parallel
group. dsrun adopts the mpu into one ParallelMesh: every rank tells the
others the ranks of its groups (one all-gather of small objects), the
groups of each axis must tile the world (disjoint, covering every rank),
and some order of the axes must lay them out as a grid (Megatron's default,
tensor innermost, then data, then pipeline, is DeepSpeed's
PipeModelDataParallelTopology; other orders are found too). The mesh is
built on that topology and uses the mpu's own group objects for the axes
it read (ParallelMesh's `adopt`), so collectives over the mesh's data axis
are collectives over the mpu's data group.

The mpu methods read, each optional except the data group:

    tensor   get_tensor_model_parallel_group, else get_model_parallel_group
             (Megatron's old name for the tensor group when the mpu has no
             pipeline group; with a pipeline group the tensor one is needed)
    data     get_data_parallel_group
    pipe     get_pipeline_model_parallel_group
    sequence get_sequence_parallel_group
"""
from __future__ import annotations

from itertools import permutations
from typing import Any

import torch.distributed as dist

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.parallel.topology import ProcessTopology


class MpuError(ValueError):
    """An mpu whose groups dsrun cannot lay out as a mesh (see [Note: adopting an mpu])."""


def _mpu_groups(mpu: Any) -> dict[str, Any]:
    """This rank's process group per mesh axis, from the mpu's methods."""
    def ask(name: str):
        method = getattr(mpu, name, None)
        return method() if callable(method) else None

    if ask("get_data_parallel_group") is None:
        raise MpuError(f"initialize(mpu=...): {type(mpu).__name__} has no get_data_parallel_group(); "
                       "an mpu must give at least its data-parallel and model-parallel groups")
    pipe = ask("get_pipeline_model_parallel_group")
    tensor = ask("get_tensor_model_parallel_group")
    if tensor is None:
        if pipe is not None:
            raise MpuError("initialize(mpu=...): the mpu has get_pipeline_model_parallel_group() but no "
                           "get_tensor_model_parallel_group(); give the tensor-parallel group too (with a "
                           "pipeline, get_model_parallel_group() is pipeline x tensor in Megatron)")
        tensor = ask("get_model_parallel_group")
    found = {"model": tensor, "data": ask("get_data_parallel_group"), "pipe": pipe,
             "sequence": ask("get_sequence_parallel_group")}
    return {axis: group for axis, group in found.items() if group is not None}


def _check_tiling(axis: str, parts: list[tuple[int, ...]], world: int) -> None:
    """Raise MpuError unless `parts` are disjoint and cover ranks 0..world-1."""
    owner: dict[int, tuple[int, ...]] = {}
    for part in parts:
        for rank in part:
            if rank in owner and owner[rank] != part:
                raise MpuError(f"initialize(mpu=...): the mpu's {axis} groups {owner[rank]} and {part} share "
                               f"rank {rank}; each rank must be in exactly one {axis} group")
            owner[rank] = part
    missing = sorted(set(range(world)) - set(owner))
    if missing:
        raise MpuError(f"initialize(mpu=...): ranks {missing} are in no {axis} group of the mpu (its groups: "
                       f"{sorted(set(parts))}); the {axis} groups must cover all {world} ranks")


def _grid(parts: dict[str, list[tuple[int, ...]]], world: int) -> ProcessTopology:
    """The topology whose groups along each axis are `parts`' (some order of the axes)."""
    sizes = {axis: len(groups[0]) for axis, groups in parts.items()}
    product = 1
    for size in sizes.values():
        product *= size
    listed = "; ".join(f"{axis}: {groups}" for axis, groups in parts.items())
    if product != world or any(len(part) != sizes[axis] for axis, groups in parts.items() for part in groups):
        raise MpuError(f"initialize(mpu=...): the mpu's groups ({listed}) do not form a grid of the {world} "
                       "ranks of the job; every group of an axis must have the same size and the sizes must "
                       "multiply to the world size")
    wanted = {axis: set(groups) for axis, groups in parts.items()}
    for order in permutations(sorted(parts)):
        topology = ProcessTopology(list(order), [sizes[axis] for axis in order])
        if all({tuple(ranks) for ranks in topology.get_axis_comm_lists(axis)} == wanted[axis] for axis in order):
            return topology
    raise MpuError(f"initialize(mpu=...): the mpu's groups ({listed}) tile the job but lie on no grid of "
                   "ranks in any order of the axes; build them from one rank grid, as Megatron's "
                   "parallel_state does")


def mesh_from_mpu(mpu: Any) -> ParallelMesh:
    """The ParallelMesh of an mpu's groups, adopting its group objects (see
    [Note: adopting an mpu]). Collective over every rank (one all-gather of
    each rank's group ranks, then the mesh's own combined groups).

    Raises:
        MpuError: no data-parallel group; groups that overlap or leave ranks
            out (naming them); groups that form no grid of the world; ranks
            whose mpus give different kinds of groups.
    """
    world = comm.get_world_size()
    handles = _mpu_groups(mpu)
    mine = {axis: tuple(sorted(dist.get_process_group_ranks(group))) for axis, group in handles.items()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    kinds = {tuple(sorted(ranks)) for ranks in every}
    if len(kinds) > 1:
        raise MpuError(f"initialize(mpu=...): the ranks' mpus give different groups ({sorted(kinds)}); "
                       "every rank must pass the same kind of mpu")
    parts = {axis: sorted({ranks[axis] for ranks in every}) for axis in mine}
    for axis, groups in parts.items():
        _check_tiling(axis, groups, world)
    topology = _grid(parts, world)
    adopt = {part: (handles[axis] if comm.get_rank() in part else None)
             for axis, groups in parts.items() for part in groups}
    return ParallelMesh(topology, adopt=adopt)

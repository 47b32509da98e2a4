"""Checkpoint names of expert parameters: by global expert id.

[Note: expert names in checkpoints]
Rank p of an expert-parallel group of P ranks holds experts p*L .. p*L+L-1
(L = E / P) as `...deepspeed_experts.0 .. L-1`, so the module's own names
repeat across the group. A checkpoint names each expert parameter by its
global expert id instead (`...deepspeed_experts.<p*L+i>...`): the name the
same model has with all experts on one rank (ep_size=1). The expert-data-
parallel group (the ranks holding the same experts) splits its writing and
shares its reads like any other replicas. A load asks for the names of the
experts it holds, whatever ep_size or world size wrote them, so a
checkpoint loads on another ep_size, another world size, and into the model
without expert parallelism (`zero_to_fp32` then `load_state_dict`).
"""
from __future__ import annotations

import torch

from dsrun.runtime.parallel.expert.groups import expert_group_name_of, expert_groups, is_expert_param
from dsrun.runtime.parallel.mesh import ParallelMesh

_EXPERTS = "deepspeed_experts."


def _split(name: str) -> tuple[str, int, str] | None:
    """(head up to the expert index, local index, rest after it) of an expert
    parameter's module name; None when it does not sit under an Experts
    module's `deepspeed_experts` list."""
    head, found, rest = name.rpartition(_EXPERTS)
    index, dot, tail = rest.partition(".")
    if not found or not index.isdigit():
        return None
    return head + found, int(index), dot + tail


def _first_and_count(param: torch.nn.Parameter, mesh: ParallelMesh) -> tuple[int, int]:
    """(global id of this rank's first expert, E) for an expert parameter of `mesh`'s expert groups."""
    groups = expert_groups(expert_group_name_of(param), mesh)
    local = getattr(param, "num_local_experts", 1)
    return groups.expert_parallel.rank * local, groups.expert_parallel.size * local


def global_expert_name(name: str, param: torch.nn.Parameter, mesh: ParallelMesh) -> str:
    """`name` (the module's qualified name of `param`) with its local expert
    index made global (see [Note: expert names in checkpoints]); `name`
    itself for a dense parameter. Reads the expert groups on `mesh` (the
    job's)."""
    parts = _split(name) if is_expert_param(param) else None
    if parts is None:
        return name
    head, index, tail = parts
    first, _ = _first_and_count(param, mesh)
    return f"{head}{first + index}{tail}"


def all_expert_names(name: str, param: torch.nn.Parameter, mesh: ParallelMesh) -> list[str]:
    """Every global name `param`'s name stands for across its
    expert-parallel group on `mesh` (E names for an expert of E, in id
    order; [`name`] for a dense parameter)."""
    parts = _split(name) if is_expert_param(param) else None
    if parts is None:
        return [name]
    head, index, tail = parts
    _, count = _first_and_count(param, mesh)
    local = getattr(param, "num_local_experts", 1)
    if index >= local:
        return [name]
    return [f"{head}{e}{tail}" for e in range(index, count, local)]


def expert_holders(param: torch.nn.Parameter, mesh: ParallelMesh):
    """The ranks holding `param` whole: its expert-data-parallel group on
    `mesh` (an object with .group, .rank, .size; see parallel/mesh.py
    MeshGroup)."""
    return expert_groups(expert_group_name_of(param), mesh).expert_data_parallel

"""Expert-parallel groups, laid out on ZeRO's group of the parallelism mesh.

[Note: expert groups]
An MoE layer with `ep_size` P splits its E experts over P ranks (E/P each).
ZeRO's group of the mesh (runtime/parallel/mesh.py), "sequence_data": the
data axis, times the sequence axis under sequence parallelism, is cut into
blocks of P consecutive ranks:

- the expert-parallel group of a rank is its block: the ranks that together
  hold one copy of every expert and exchange tokens by all-to-all;
- its expert-data-parallel group is the ranks at the same place in every
  block: they hold the same experts, and the experts' gradients are summed
  over it (the other parameters over the whole data axis).

Sequence ranks hold the same experts as their data rank and route their
own slice of the tokens: they are ranks of ZeRO's group like the data
ranks (a token's expert output does not depend on the other tokens, so any
block of that group may exchange tokens). Blocks of the data axis alone
left the sequence ranks' expert gradients unsummed (each sequence rank
trained its experts on its slice only).

Without sequence parallelism this is DeepSpeed's layout (utils/groups.py
`_create_expert_and_data_parallel`):
world 16, ep 2 -> expert-parallel [0,1], [2,3], ..., [14,15];
expert-data-parallel [0,2,...,14], [1,3,...,15]. The groups are named
`ep_size_<P>` (DeepSpeed's names; a parameter's `group_name`) and are the
mesh's `data_blocks(P, "sequence_data")` (blocks of ZeRO's group, data x
sequence), made on first use (a layer's first forward, or `initialize`
reading the expert parameters) on the mesh current then.

They are made as local groups (mesh.py [Note: groups of some ranks only]):
only this rank's two groups, by their members alone. An MoE layer may sit
on some pipeline stages only, and the other stages' ranks never ask for its
groups; a collective new_group would leave those ranks behind in torch's
group counter and hang the next group the whole job makes. The members of
an expert group are ranks of ZeRO's group (data x sequence) of one stage,
which run the same layers in the same order, so they ask for the groups at
the same point. (DeepSpeed creates them collectively when its engine
starts, and hangs there in that case.)
"""
from __future__ import annotations

from dataclasses import dataclass

from dsrun.runtime.parallel.mesh import MeshGroup, ParallelMesh, torch_group


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's groups for one expert-parallel degree.

    name: "ep_size_<P>". expert_parallel: the P ranks exchanging tokens.
    expert_data_parallel: the ranks of ZeRO's group holding the same
    experts. data_size: the size of ZeRO's group (expert gradients are
    averaged over it: each copy of an expert sees the tokens of its whole
    expert-parallel group, so their sum over the expert-data group covers
    every rank of ZeRO's group).
    """

    name: str
    expert_parallel: MeshGroup
    expert_data_parallel: MeshGroup
    data_size: int

    @property
    def ep_group(self):
        """The torch process group of `expert_parallel` (never None once
        torch.distributed is initialised)."""
        return torch_group(self.expert_parallel)

    @property
    def expert_data_group(self):
        """The torch process group of `expert_data_parallel`."""
        return torch_group(self.expert_data_parallel)


class _Registry:
    mesh: ParallelMesh | None = None
    groups: dict[str, ExpertGroups] = {}


def group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups of degree `ep_size`."""
    return f"ep_size_{ep_size}"


def create_expert_groups(ep_size: int, mesh: ParallelMesh) -> ExpertGroups:
    """The groups of degree `ep_size` on `mesh` (the engine's; a layer a
    script builds passes the declared mesh), created on the first call for
    it (by the members of this rank's groups, which must all call it: see
    [Note: expert groups]).

    Raises:
        ValueError: ep_size < 1 or it does not divide the size of ZeRO's group.
    """
    if _Registry.mesh is not mesh:
        _Registry.mesh, _Registry.groups = mesh, {}
    name = group_name(ep_size)
    if name not in _Registry.groups:
        data = mesh.size("sequence_data")
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or data % ep_size:
            raise ValueError(f"MoE: ep_size={ep_size!r} must be a positive divisor of the data-parallel "
                             f"size {data} (world size / (pipe x model), the data ranks times the sequence "
                             f"ranks); choose ep_size among {[d for d in range(1, data + 1) if data % d == 0]}")
        blocks = mesh.data_blocks(ep_size, "sequence_data", local=True)
        _Registry.groups[name] = ExpertGroups(name, blocks.block, blocks.replicate, data)
    return _Registry.groups[name]


def expert_groups(name: str, mesh: ParallelMesh) -> ExpertGroups:
    """The groups named `name` ("ep_size_<P>", a parameter's `group_name`) on
    `mesh`; created when no MoE layer has made them yet (as
    create_expert_groups).

    Raises:
        ValueError: a name not of the form "ep_size_<P>", or a P that
            create_expert_groups refuses.
    """
    prefix, _, degree = name.rpartition("_")
    if prefix != "ep_size" or not degree.isdigit():
        raise ValueError(f"expert group name {name!r} is not DeepSpeed's 'ep_size_<P>'; expert parameters "
                         "carry the group_name their MoE layer gave them")
    return create_expert_groups(int(degree), mesh)


def expert_group_names(mesh: ParallelMesh) -> list[str]:
    """The names of the expert groups made on `mesh`."""
    return sorted(_Registry.groups) if _Registry.mesh is mesh else []


def is_expert_param(param) -> bool:
    """Whether `param` is an expert parameter (DeepSpeed's mark:
    `allreduce` is False; its `group_name` names its expert groups)."""
    return getattr(param, "allreduce", True) is False


def expert_group_name_of(param) -> str:
    """The expert groups' name an expert parameter carries.

    Raises:
        ValueError: an expert parameter (allreduce=False) without group_name.
    """
    name = getattr(param, "group_name", None)
    if name is None:
        raise ValueError("a parameter marked allreduce=False (an expert parameter) has no group_name; "
                         "set param.group_name = 'ep_size_<P>' (DeepSpeed's MoE layer sets both)")
    return name

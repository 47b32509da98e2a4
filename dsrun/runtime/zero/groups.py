"""Which ranks share a partition and which ranks hold copies of it.

[Note: shard group and replicate group]
ZeRO state is described by a pair of rank groups:

- the *shard group*: the ranks a FlatLayout is partitioned over (its
  world_size); each holds one shard of every bucket;
- the *replicate group*: the ranks that hold the SAME shard (equal rank in
  their shard groups); their gradients are summed with an all-reduce.

Gradients of a bucket are reduce-scattered over the shard group, then
all-reduced over the replicate group, and divided by shard x replicate
size. Stages 1-3 use (world, nobody): plain ZeRO. Stage 0 with 16-bit
precision uses (nobody, world): every rank holds everything, gradients are
all-reduced. Hierarchical schemes (ZeRO++ hpZ, HSDP, MiCS) are other pairs;
nothing in the strategies assumes either group is trivial. MiCS (Zhang et
al., "MiCS: Near-linear Scaling for Training Gigantic Model on Public
Cloud", VLDB 2023, Section 3.2 partition groups and replication groups) is
`ZeroGroups.mics(k)`: the shard group is a block of k consecutive data-parallel
ranks, the replicate group the ranks at the same position in every block,
so parameter gathers stay within the k ranks (a node, when k = ranks per
node) and only the gradient all-reduce crosses blocks.

[Note: node groups]
Node-aware schemes need two more groups, built from the node map
(dsrun/runtime/distributed/nodes.py, learnt by init_distributed):

    from dsrun.runtime.zero.groups import node_groups
    groups = node_groups(mesh)  # NodeGroups(intra=RankGroup, inter=RankGroup)
    groups.intra                # this rank's node (LOCAL_WORLD_SIZE ranks)
    groups.inter                # one rank per node: those with this rank's local rank

`mesh` is the job's ParallelMesh, the one place process groups are made
(the engine's `engine.mesh`). Creating a process group is collective over
EVERY rank of the job (each rank creates every node's group, in the same
order), so the first call of `node_groups(mesh)` must be made by all ranks
at the same point, e.g. while building a strategy; later calls with the
same mesh return its cached groups without communication. A group of one
rank is RankGroup.alone() (no communication), the whole job is the default
group.
ZeRO++ hpZ's and qgZ's groups split ZeRO's group (the mesh's data axis)
instead: ParallelMesh.data_blocks, see stage3.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed import ProcessGroup

from dsrun.runtime import comm
from dsrun.runtime.config import ConfigError
from dsrun.runtime.distributed import nodes

if TYPE_CHECKING:
    from dsrun.runtime.parallel.mesh import ParallelMesh


@dataclass(frozen=True)
class RankGroup:
    """A process group and this rank's place in it.

    group: the torch process group (None = the default group; ignored when
    size == 1, which needs no communication). rank: this process's rank in
    it. size: its number of ranks.
    """

    group: ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, group: ProcessGroup | None = None) -> "RankGroup":
        """This rank in `group` (None = every rank)."""
        return cls(group, comm.get_rank(group), comm.get_world_size(group))

    @classmethod
    def alone(cls) -> "RankGroup":
        """A group of this rank only: no communication."""
        return cls(None, 0, 1)


@dataclass(frozen=True)
class ZeroGroups:
    """The (shard group, replicate group) pair; see [Note: shard group and replicate group]."""

    shard: RankGroup
    replicate: RankGroup

    @classmethod
    def sharded(cls, group: ProcessGroup | None = None) -> "ZeroGroups":
        """ZeRO stages 1-3: partitioned over `group`, no replicas."""
        return cls(RankGroup.of(group), RankGroup.alone())

    @classmethod
    def replicated(cls, group: ProcessGroup | None = None) -> "ZeroGroups":
        """Every rank of `group` holds everything (stage 0, 16-bit)."""
        return cls(RankGroup.alone(), RankGroup.of(group))

    @classmethod
    def mics(cls, shard_size: int, mesh: "ParallelMesh", axis: str = "data") -> "ZeroGroups":
        """MiCS over ZeRO's group of `mesh`: shards within blocks of
        `shard_size` consecutive ranks of the `axis` group, replicas across
        the blocks. `axis` is the group ZeRO partitions over: "data", or
        "sequence_data" under sequence parallelism (the blocks must split
        the ranks holding the same parameters; blocking the data axis alone
        would leave the sequence ranks' gradients unsummed). Collective over
        every rank the first time for a size (the groups are created then,
        see ParallelMesh.data_blocks).

        Raises:
            ConfigError: `shard_size` does not divide the size of that group.
        """
        size = mesh.size(axis)
        if shard_size < 1 or size % shard_size:
            what = "data-parallel" if axis == "data" else f"{axis} (ZeRO's group)"
            raise ConfigError(f"zero_optimization.mics_shard_size={shard_size} does not divide the "
                              f"{what} size {size}; set it to a divisor of it (the ranks "
                              "per node, usually), or to -1 for plain ZeRO")
        blocks = mesh.data_blocks(shard_size, axis)
        return cls(RankGroup(blocks.block.group, blocks.block.rank, blocks.block.size),
                   RankGroup(blocks.replicate.group, blocks.replicate.rank, blocks.replicate.size))

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: shard size x replicate size."""
        return self.shard.size * self.replicate.size


@dataclass(frozen=True)
class NodeGroups:
    """This rank's node groups; see [Note: node groups].

    intra: the ranks of this rank's node. inter: the ranks with this rank's
    local rank, one per node (fewer when nodes differ in size).
    """

    intra: RankGroup
    inter: RankGroup


def _subgroup(mesh: "ParallelMesh", parts: tuple[tuple[int, ...], ...]) -> RankGroup:
    """This rank's group among `parts` (disjoint global-rank tuples covering
    the job), made by the job's parallelism mesh `mesh` -- the one place
    process groups are created (collective over all ranks the first time,
    cached there). The whole job is the default group (None); a rank in no
    part is alone."""
    made = mesh.make_group(list(parts))
    if made is None or made.size == 1:
        return RankGroup.alone()
    if made.size == comm.get_world_size():
        return RankGroup.of(None)
    return RankGroup(made.group, made.rank, made.size)


def node_groups(mesh: "ParallelMesh") -> NodeGroups:
    """This rank's intra-node and inter-node groups (see [Note: node groups]),
    made by `mesh` (the job's ParallelMesh).

    Collective over every rank the first time for a mesh. Raises
    nodes.NodeMapError when the node map is unknown (init_distributed not
    called, or a rank environment that does not describe nodes)."""
    node_map = nodes.require()
    return NodeGroups(_subgroup(mesh, node_map.nodes), _subgroup(mesh, node_map.same_local_rank()))

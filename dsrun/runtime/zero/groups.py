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
nothing in the strategies assumes either group is trivial.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import ProcessGroup

from dsrun.runtime import comm


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

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: shard size x replicate size."""
        return self.shard.size * self.replicate.size

"""The parallelism mesh: every process group of a job, from one topology.

[Note: the parallelism mesh]
A job's ranks sit on a grid (runtime/parallel/topology.py) with the axes,
outer to inner,

    pipe      pipeline stages          (each holds some layers)
    data      data-parallel replicas   (gradients averaged over it)
    sequence  sequence-parallel ranks  (each holds a slice of the tokens)
    model     tensor-parallel ranks    (each holds a slice of each weight)

This order is DeepSpeed's PipeModelDataParallelTopology with sequence
inserted inside data: in a pipe x data job the data axis is innermost, so
gradient all-reduces run among consecutive ranks (one node) and only the
pipeline's activations cross nodes. A mesh may also be built from any
DeepSpeed ProcessTopology; it then follows that topology's axes and order,
and the axes above that it lacks have one rank.

The mesh owns these groups ("axis groups"):

- one per axis: the ranks that differ only on that axis;
- "sequence_data" (data x sequence): the ranks that hold the same
  parameters, over which ZeRO partitions when sequence parallelism is on
  (DeepSpeed's sequence-data-parallel group);
- "pipe_model" (pipe x model): the ranks that together hold one copy of the
  model; DeepSpeed's PipelineParallelGrid calls this the model-parallel
  group and reduces gradient norms and overflow flags over it.

Pipeline neighbours are not groups: the pipeline sends and receives on the
default group.

[Note: creating the mesh's groups]
torch.distributed.new_group is collective over the whole job: every rank
must call it for every group, members or not, in the same order. The mesh
therefore creates all its groups when it is constructed, on every rank, in
one order computed from the topology alone (axes in topology order, then
sequence_data, then pipe_model; within one kind, groups by the coordinates
of the other axes). A group equal to one already made (e.g. sequence_data
when sequence has one rank) is that group again; a group of the whole job
is the default group; a group of one rank gets no process group (its
record's `group` is None, and it needs no communication). So a pure
data-parallel mesh creates no group at all, which is why `current()` can
build the default mesh lazily, on any rank, at any time.

`data_blocks(block_size)` splits the data axis further (ZeRO++ hpZ's
secondary partition, hybrid sharding): its groups are created on the first
call for a block size, so that first call must be made by all ranks at the
same point, like the construction -- unless it asks for local groups.

[Note: groups of some ranks only]
Groups that only some ranks ever ask for -- the expert groups of an MoE
layer that sits on some pipeline stages only -- cannot be made the
collective way: the ranks that never call new_group would fall behind in
torch's group counter, which names every collectively made group, and the
next group the whole job makes would get different names on different
ranks and hang. `data_blocks(..., local=True)` therefore makes only this
rank's two groups, with `new_group(use_local_synchronization=True)`: only
the members call it, it does not advance the counter, and the group is
named from its ranks and the number of groups the calling rank belongs to
(torch's `_hash_ranks_to_str`). So the members must call in the same order
(blocks, then replicas; block sizes in the order of first use) and must
belong to as many groups when they do. The mesh's own groups give every
rank one group per axis, so they agree; the one-rank group `torch_group`
makes lazily (on some ranks only) is made first, on every member, so it
cannot tell them apart. gloo and NCCL support this; MPI does not.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from dsrun.runtime import comm
from dsrun.runtime.parallel.topology import PipeModelDataParallelTopology, ProcessTopology

AXES = ("pipe", "data", "sequence", "model")
COMBINED = {"sequence_data": ("data", "sequence"), "pipe_model": ("pipe", "model")}


@dataclass(frozen=True)
class MeshGroup:
    """One group of the mesh and this rank's place in it.

    ranks: the group's global ranks, ascending. rank: this process's index
    in `ranks` (its rank in the group). group: the torch process group to
    pass to collectives; None when the group is this rank alone (size 1:
    nothing to communicate -- do not pass None to torch, which reads it as
    the default group).
    """

    ranks: tuple[int, ...]
    rank: int
    group: ProcessGroup | None

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        return len(self.ranks)


@dataclass(frozen=True)
class DataBlocks:
    """This rank's split of a data axis into blocks (see ParallelMesh.data_blocks).

    block: the `block_size` consecutive ranks of the axis this rank's block
    holds (ZeRO++ hpZ's secondary partition group; a shard group). replicate:
    the ranks at this rank's position in every block (they hold the same
    shard; the replicate group of zero/groups.py's [Note: shard group and
    replicate group]). block.size * replicate.size is the axis size.
    """

    block: MeshGroup
    replicate: MeshGroup


def _world_token():
    """A reference to the current default process group (None before init)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return weakref.ref(world) if world is not None else None


def _same_world(token) -> bool:
    now = dist.group.WORLD if dist.is_initialized() else None
    return (token() if token is not None else None) is now


class ParallelMesh:
    """The process groups of a job laid out by a ProcessTopology; see
    [Note: the parallelism mesh] and [Note: creating the mesh's groups].

    Construction is collective over every rank of the default group (all
    ranks must construct the same mesh at the same point).

    Args:
        topology: the rank layout; its world size must be the job's.
        adopt: process groups that exist already (an mpu's, see
            runtime/parallel/mpu.py), by their ranks: the mesh uses them
            instead of creating groups of those ranks. Every rank must pass
            the same keys (value None for a group this rank is not in), so
            that every rank skips the same new_group calls.

    Raises:
        ValueError: the topology's world size is not the number of ranks,
            or an axis is named like a combined group.
    """

    def __init__(self, topology: ProcessTopology,
                 adopt: dict[tuple[int, ...], ProcessGroup | None] | None = None) -> None:
        world = comm.get_world_size()
        if topology.world_size() != world:
            raise ValueError(f"ParallelMesh: the topology {topology.get_axis_names()} x {topology.dims} "
                             f"has {topology.world_size()} ranks but the job has {world}; "
                             "choose dims whose product is the world size")
        clash = [axis for axis in topology.get_axis_names() if axis in COMBINED]
        if clash:
            raise ValueError(f"ParallelMesh: topology axis {clash} has the name of a combined group; "
                             "rename the axis")
        self.topology = topology
        self.world_size = world
        self.global_rank = comm.get_rank()
        self._world = _world_token()
        self._made: dict[tuple[int, ...], ProcessGroup | None] = dict(adopt or {})
        self._made_locally: dict[tuple[int, ...], ProcessGroup] = {}  # see [Note: groups of some ranks only]
        self._parts: dict[str, list[tuple[int, ...]]] = {}
        self._groups: dict[str, MeshGroup] = {}
        self._blocks: dict[tuple[str, int, bool], DataBlocks] = {}
        names = list(topology.get_axis_names()) + [a for a in AXES if a not in topology.get_axis_names()]
        for name in names:
            self._add(name, (name,))
        for name, axes in COMBINED.items():
            self._add(name, axes)

    @classmethod
    def build(cls, world_size: int, pipe: int = 1, model: int = 1, sequence: int = 1) -> "ParallelMesh":
        """The mesh of `world_size` ranks with these degrees; data gets the
        rest: world_size // (pipe * model * sequence). Without sequence
        parallelism the topology is DeepSpeed's PipeModelDataParallelTopology
        (so checkpoint names from get_rank_repr match DeepSpeed's); with it,
        axes ['pipe', 'data', 'sequence', 'model'].

        Raises:
            ValueError: a degree < 1, or pipe * model * sequence does not
                divide world_size, or world_size is not the job's.
        """
        for name, degree in (("pipe", pipe), ("model", model), ("sequence", sequence)):
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ValueError(f"ParallelMesh.build: {name}={degree!r}; degrees must be integers >= 1")
        inner = pipe * model * sequence
        if world_size < 1 or world_size % inner:
            raise ValueError(f"ParallelMesh.build: pipe x model x sequence = {pipe} x {model} x {sequence} "
                             f"= {inner} does not divide the world size {world_size}; choose degrees "
                             "whose product divides it (data parallelism takes the rest)")
        data = world_size // inner
        if sequence == 1:
            topology = PipeModelDataParallelTopology(num_pp=pipe, num_mp=model, num_dp=data)
        else:
            topology = ProcessTopology(list(AXES), [pipe, data, sequence, model])
        return cls(topology)

    # -- group creation (see [Note: creating the mesh's groups]) ----------

    def _partition(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """The groups along `axes` (those the topology has): ranks sharing
        their coordinates on every other axis, ordered by first rank."""
        names = self.topology.get_axis_names()
        fixed = [i for i, name in enumerate(names) if name not in axes]
        parts: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coord = self.topology.get_coord(rank)
            parts.setdefault(tuple(coord[i] for i in fixed), []).append(rank)
        return [tuple(part) for part in parts.values()]

    def make_group(self, parts: list[tuple[int, ...]], local: bool = False) -> MeshGroup | None:
        """This rank's group among `parts` (disjoint tuples of global ranks),
        creating every part's process group in order (collective over the
        job: every rank passes the same parts). None when this rank is in
        none of them (e.g. a stage that holds no copy of a tied weight).
        The mesh's own axes cover the job; other callers (tied weights of
        a pipeline) may pass fewer ranks.

        local: create only this rank's part, and only its members take part
        (see [Note: groups of some ranks only]); the other parts are skipped.
        """
        mine = None
        for part in parts:
            member = self.global_rank in part
            if local and not member:
                continue
            if len(part) == 1:
                group = None
            elif len(part) == self.world_size:
                group = dist.group.WORLD
            elif part in self._made:  # made by every rank: every member has it
                group = self._made[part]
            elif local:
                if part not in self._made_locally:
                    self._made_locally[part] = _local_group(part)
                group = self._made_locally[part]
            else:
                group = self._made[part] = dist.new_group(list(part))  # every rank creates every group
            if member:
                mine = MeshGroup(part, part.index(self.global_rank), group)
        return mine

    def _add(self, name: str, axes: tuple[str, ...]) -> None:
        self._parts[name] = self._partition(axes)
        self._groups[name] = self.make_group(self._parts[name])

    # -- questions ---------------------------------------------------------

    def axis_group(self, axis: str) -> MeshGroup:
        """This rank's group along `axis`: an axis name (those of AXES and
        of the topology) or a combined group ("sequence_data",
        "pipe_model").

        Raises:
            ValueError: an unknown name.
        """
        if axis not in self._groups:
            raise ValueError(f"ParallelMesh: no group {axis!r}; the mesh has {sorted(self._groups)}")
        return self._groups[axis]

    def group(self, axis: str) -> ProcessGroup | None:
        """The torch process group along `axis` (see axis_group), to pass to
        collectives. For a group of this rank alone it is a one-rank group,
        made on first request by this rank only (not collective), so that
        DeepSpeed-style code passing it to a collective never reaches the
        whole job; None when torch.distributed is not initialised."""
        return torch_group(self.axis_group(axis))

    def rank(self, axis: str) -> int:
        """This rank's rank in its group along `axis` (its coordinate on a
        single axis)."""
        return self.axis_group(axis).rank

    def size(self, axis: str) -> int:
        """The number of ranks in a group along `axis` (1 for an axis the
        topology lacks)."""
        return self.axis_group(axis).size

    def ranks(self, axis: str) -> tuple[int, ...]:
        """The global ranks, ascending, of this rank's group along `axis`."""
        return self.axis_group(axis).ranks

    def partition(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along `axis` (not only this rank's), each as its
        global ranks ascending, ordered by first rank: what every rank can
        check alike before a collective (e.g. that blocks of data_blocks
        stay within nodes). Not collective.

        Raises:
            ValueError: an unknown name (see axis_group).
        """
        self.axis_group(axis)
        return list(self._parts[axis])

    def coord(self, global_rank: int) -> tuple:
        """The topology coordinate (a ProcessCoord namedtuple) of a global rank.

        Raises:
            ValueError: rank out of range.
        """
        return self.topology.get_coord(global_rank)

    def stage_to_global(self, stage: int, **coords: int) -> int:
        """The global rank at pipeline stage `stage` whose other coordinates
        are this rank's, except those given in `coords` (e.g. data=1).

        Raises:
            ValueError: a stage or coordinate out of range, an unknown axis,
                or stage != 0 on a topology without a pipe axis.
        """
        me = self.coord(self.global_rank)._asdict()
        if "pipe" in me:
            me["pipe"] = stage
        elif stage != 0:
            raise ValueError(f"stage_to_global({stage}): this topology {self.topology.get_axis_names()} "
                             "has no pipe axis, so the only stage is 0")
        unknown = [axis for axis in coords if axis not in me]
        if unknown:
            raise ValueError(f"stage_to_global: unknown axis {unknown}; the axes are {list(me)}")
        me.update(coords)
        return self.topology.get_rank(**me)

    def belongs_to_current_world(self) -> bool:
        """Whether the default process group is still the one this mesh was
        built on (it is not after destroy_process_group and a new init)."""
        return _same_world(self._world)

    def data_blocks(self, block_size: int, axis: str = "data", local: bool = False) -> DataBlocks:
        """This rank's split of its `axis` group into blocks of `block_size`
        consecutive members, and the replicate group across the blocks.

        With data ranks d0..d7 (in axis order) and block_size 4: blocks
        {d0..d3}, {d4..d7}; replicate groups {d0,d4}, {d1,d5}, {d2,d6},
        {d3,d7}. The groups of every other coordinate (each stage, each
        model rank) are split alike. `axis` may be "sequence_data" (ZeRO's
        group under sequence parallelism).

        Collective over every rank the first time for an (axis, block_size)
        (see [Note: creating the mesh's groups]); cached after. With
        `local`, only this rank's block and replicate groups are made, and
        only their members need call (see [Note: groups of some ranks
        only]): what layers on some pipeline stages only use.

        Raises:
            ValueError: block_size does not divide the axis size; unknown axis.
        """
        size = self.size(axis)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 \
                or size % block_size:
            raise ValueError(f"data_blocks: blocks of {block_size!r} ranks do not divide the {axis!r} "
                             f"axis of {size} ranks; choose a divisor of {size}")
        key = (axis, block_size, local)
        if key not in self._blocks:
            parts = self.partition(axis)
            blocks = [part[s:s + block_size] for part in parts for s in range(0, size, block_size)]
            replicas = [part[i::block_size] for part in parts for i in range(block_size)]
            self._blocks[key] = DataBlocks(self.make_group(blocks, local), self.make_group(replicas, local))
        return self._blocks[key]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.size(a)}" for a in self.topology.get_axis_names())
        return f"ParallelMesh({sizes}; rank {self.global_rank} of {self.world_size})"


class _Alone:
    token = None
    group: ProcessGroup | None = None


def _alone_group() -> ProcessGroup:
    """A process group of this rank only, one per default group, made by
    this rank alone (new_group with local synchronisation involves no other
    rank and does not advance the collective group counter)."""
    if _Alone.group is None or not _same_world(_Alone.token):
        _Alone.group = dist.new_group([comm.get_rank()], use_local_synchronization=True)
        _Alone.token = _world_token()
    return _Alone.group


def _local_group(ranks: tuple[int, ...]) -> ProcessGroup:
    """A process group of `ranks` (this rank among them) made by its members
    only; see [Note: groups of some ranks only]."""
    _alone_group()  # every member holds it before the name is drawn from its group count
    return dist.new_group(list(ranks), use_local_synchronization=True)


class _Current:
    mesh: ParallelMesh | None = None      # set by the runtime (set_current)
    default: ParallelMesh | None = None   # built by current() when none is set


def set_current(mesh: ParallelMesh | None) -> None:
    """Make `mesh` the job's mesh (the runtime does this when it starts);
    None returns to the default data-parallel mesh.

    Raises:
        ValueError: `mesh` was built on a default process group that is gone.
    """
    if mesh is not None and not mesh.belongs_to_current_world():
        raise ValueError("set_current: this mesh was built on a process group that no longer exists; "
                         "build a new ParallelMesh after init_distributed")
    _Current.mesh = mesh


def current() -> ParallelMesh:
    """The declared mesh (see [Note: the declared mesh]): the one given to
    set_current, or else (or once the default process group it was built
    on is gone) the pure data-parallel mesh of the default group -- data =
    world size, every other axis one rank -- built on the first call.
    Building it creates no process group (see [Note: creating the mesh's
    groups]), so any rank may call this at any time; before
    torch.distributed is initialised it is a mesh of one rank.

    [Note: the declared mesh]
    The process-global mesh serves what is built before or outside the
    engine: DeepSpeed's answers (`dsrun.utils.groups`, and the model-parallel
    rank activation checkpointing seeds its RNG with when no mpu was given)
    and what a script builds or calls before `initialize` and outside it:
    Megatron layers given no mesh (tensor/layers.py), MoE layers
    (expert/layer.py), shard_sequence, sequence_parallel_loss and
    wrap_hf_attention given no group, `tp_model_init`, and
    `init_distributed(config=...)`, which declares it. They all read it
    through this function, the one accessor of the global. `initialize`
    reads it once, when it begins: it is the mesh the script built its
    layers on. From there the engine owns the job's mesh (`engine.mesh`):
    compose keeps the declared one when it has the job's degrees, or builds
    another and makes it current (so DeepSpeed's answers and the script's
    layers agree with the engine), and hands it, as an argument, to
    everything inside the engine -- the strategies, ZeRO's groups, expert
    groups, the pipeline and the checkpointer. tests/test_import_structure.py
    lists the modules allowed to call current().
    """
    if _Current.mesh is not None and _Current.mesh.belongs_to_current_world():
        return _Current.mesh
    default = _Current.default
    if default is None or not default.belongs_to_current_world():
        default = _Current.default = ParallelMesh.build(comm.get_world_size())
    return default



def torch_group(record: MeshGroup) -> ProcessGroup | None:
    """The process group to pass to a collective for `record`: its own, or
    for a group of this rank alone a one-rank group (see ParallelMesh.group);
    None when torch.distributed is not initialised."""
    if record.group is not None or not dist.is_initialized():
        return record.group
    return _alone_group()

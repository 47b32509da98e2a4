"""Which node each rank is on.

[Note: nodes from the rank environment]
A node is the set of ranks that share one LOCAL_RANK numbering: rank r with
local rank l belongs to the node whose local rank 0 is global rank r - l,
and that node has LOCAL_WORLD_SIZE ranks. dsrun's launcher numbers ranks
node-major (launcher/placement.py: node 0 holds ranks 0..n0-1, node 1 the
next n1, ...), and so do torchrun, Slurm's block distribution and mpirun's
default mapping, so every node is a run of consecutive ranks. Nodes may
differ in size (a hostfile with different slot counts).

`init_distributed` learns the map once per process group: each rank sends
(rank - local rank, LOCAL_WORLD_SIZE) in one all-gather of 2 integers per
rank (set-up traffic, not counted by the comms logger, like the shared-
memory agreement in comm/collectives.py), so every rank holds the same map
and can create subgroups over it (zero/groups.py `node_groups`). The map is
checked: every node must hold exactly LOCAL_WORLD_SIZE consecutive ranks
with local ranks 0..LOCAL_WORLD_SIZE-1. An environment that breaks this
(for instance mpirun mapping ranks round-robin over nodes, which gives
local ranks that are not of this form) yields no map: a warning says so,
node-aware features (hpZ, the node groups) refuse to start, and the comms
logger counts every collective as intra-node.

On one machine, "nodes" are whatever the environment says: 4 ranks started
with LOCAL_WORLD_SIZE=2 and LOCAL_RANK = rank % 2 are 2 nodes of 2 ranks.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref

import torch
import torch.distributed as dist

from dsrun.runtime.distributed.torch_collectives import all_gather_single

log = logging.getLogger("dsrun.nodes")


class NodeMapError(RuntimeError):
    """A node-aware feature was asked for but the ranks' node map is unknown or unsuitable."""


@dataclasses.dataclass(frozen=True)
class NodeMap:
    """The nodes of a job: `nodes[i]` is the tuple of global ranks on node i,
    in rank order; nodes are ordered by their first rank."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int) -> "NodeMap":
        """world_size ranks in consecutive nodes of ranks_per_node (must divide it)."""
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"{ranks_per_node} ranks per node do not divide a world of {world_size}")
        return cls(tuple(tuple(range(s, s + ranks_per_node)) for s in range(0, world_size, ranks_per_node)))

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int | None:
        """Ranks on every node when all nodes have the same number, else None."""
        sizes = {len(n) for n in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def node_of(self, rank: int) -> int:
        """Index of the node holding global `rank`. Raises ValueError for an unknown rank."""
        for i, node in enumerate(self.nodes):
            if rank in node:
                return i
        raise ValueError(f"rank {rank} is on no node of {self.nodes}")

    def within_one_node(self, ranks) -> bool:
        """True when every global rank in `ranks` is on the same node."""
        return len({self.node_of(r) for r in ranks}) <= 1

    def same_local_rank(self) -> tuple[tuple[int, ...], ...]:
        """Ranks with local rank i on every node that has one, for each i:
        the inter-node groups (ZeRO++ and hierarchical all-reduces send
        across nodes only between these)."""
        depth = max(len(n) for n in self.nodes)
        return tuple(tuple(n[i] for n in self.nodes if len(n) > i) for i in range(depth))


def map_from_reports(reports: list[tuple[int, int]]) -> NodeMap | None:
    """The NodeMap of ranks whose reports (rank - LOCAL_RANK, LOCAL_WORLD_SIZE)
    are given in rank order, or None when they do not describe nodes of
    consecutive ranks (see [Note: nodes from the rank environment])."""
    nodes: dict[int, list[int]] = {}
    for rank, (first, size) in enumerate(reports):
        if size < 1 or not 0 <= first <= rank < first + size:
            return None
        nodes.setdefault(first, []).append(rank)
    for first, ranks in nodes.items():
        if ranks != list(range(first, first + reports[first][1])) or \
                any(reports[r] != reports[first] for r in ranks):
            return None
    return NodeMap(tuple(tuple(nodes[f]) for f in sorted(nodes)))


class _Current:
    pg: weakref.ref | None = None  # the default group the map was learnt for
    nodes: NodeMap | None = None


def learn(rank: int, world_size: int, local_rank: int, local_world_size: int,
          device: torch.device | str = "cpu") -> NodeMap | None:
    """Learn (or return the already learnt) node map of the current default
    group; collective over every rank the first time for a group (all ranks
    call it from `init_distributed`). device: where the backend's tensors
    live (cuda for nccl). Returns None when the ranks' LOCAL_RANK /
    LOCAL_WORLD_SIZE do not describe nodes (a warning on rank 0 says why)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not None and _Current.pg is not None and _Current.pg() is world:
        return _Current.nodes
    if world_size == 1:
        nodes = NodeMap(((0,),))
    else:
        mine = torch.tensor([rank - local_rank, local_world_size], dtype=torch.int64, device=device)
        every = torch.empty(2 * world_size, dtype=torch.int64, device=device)
        all_gather_single(every, mine)  # set-up traffic, not counted
        reports = [tuple(int(v) for v in pair) for pair in every.view(world_size, 2).tolist()]
        nodes = map_from_reports(reports)
        if nodes is None and rank == 0:
            log.warning("dsrun: LOCAL_RANK/LOCAL_WORLD_SIZE of the ranks do not describe nodes of "
                        "consecutive ranks (rank - LOCAL_RANK, LOCAL_WORLD_SIZE per rank: %s); "
                        "node-aware features (ZeRO++ hpZ, node groups) are unavailable and the "
                        "comms logger counts all traffic as intra-node", reports)
    _Current.pg = weakref.ref(world) if world is not None else None
    _Current.nodes = nodes
    return nodes


def current() -> NodeMap | None:
    """The node map learnt for the current default group, or None (not
    learnt yet, or the environment does not describe nodes)."""
    if not dist.is_initialized() or _Current.pg is None or _Current.pg() is not dist.group.WORLD:
        return None
    return _Current.nodes


def require() -> NodeMap:
    """`current()`, or NodeMapError saying why a node-aware feature cannot run."""
    nodes = current()
    if nodes is None:
        raise NodeMapError("the ranks' node map is unknown: call dsrun.init_distributed() (or "
                           "dsrun.initialize) first, and launch with LOCAL_RANK/LOCAL_WORLD_SIZE that "
                           "number each node's ranks 0..n-1 over consecutive global ranks (dsrun, "
                           "torchrun and Slurm do)")
    return nodes


_spans: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def spans_nodes(group=None) -> bool:
    """True when the ranks of process group `group` (None = the default
    group) sit on more than one node; False without a node map. Cached per
    group (no communication)."""
    nodes = current()
    if nodes is None or nodes.num_nodes == 1:
        return False
    if group is None or group is dist.group.WORLD:
        return True
    found = _spans.get(group)
    if found is None or found[0] is not nodes:
        found = (nodes, not nodes.within_one_node(dist.get_process_group_ranks(group)))
        _spans[group] = found
    return found[1]

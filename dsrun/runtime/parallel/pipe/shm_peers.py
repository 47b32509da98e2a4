"""Shared-memory channels for the pipeline's point-to-point traffic between
ranks of one node (see p2p.py [Note: the transport of a stage link]).

`ShmPeers` decides, once per `StageLink`, which ranks this rank can reach
over dsrun.ops.shm_comm's `ShmChannel`s, and holds those channels: one per
(sender, receiver, tag), opened on the first message of the stream.
"""
from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist

from dsrun.env import JOB_ID, SHM_COMM
from dsrun.ops import shm_comm
from dsrun.runtime.distributed import nodes
from dsrun.runtime.distributed.torch_collectives import all_gather_single


class ShmPeers:
    """The shared-memory channels of one stage link.

    Created at a point every rank reaches in the same order (the pipeline
    engine's construction): when the default group is a gloo group of
    several ranks and `device` is the CPU, the ranks exchange, in one
    all-gather of 2 integers per rank (set-up traffic, not counted), whether
    each can use shared memory (DSRUN_SHM_COMM not 0 and the native op
    loaded) and its process id. Rank q is then a shared-memory peer of this
    rank when both can and both are on this node (nodes.py's map; without a
    map, when LOCAL_WORLD_SIZE == WORLD_SIZE). Both ranks of a pair reach the
    same answer, so they always use the same transport for each other.

    Args:
        device: the stage's compute device; only "cpu" uses channels.
    """

    _links = itertools.count()  # counted alike on every rank: names the segments of each link

    def __init__(self, device: torch.device) -> None:
        self._pids: dict[int, int] = {}  # shared-memory peer -> its process id
        self._channels: dict[tuple[int, int, int], shm_comm.ShmChannel] = {}
        if not (dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo"
                and torch.device(device).type == "cpu"):
            return  # the same on every rank: no agreement needed
        self.rank, world = dist.get_rank(), dist.get_world_size()
        able = SHM_COMM.read() and shm_comm.available()
        every = torch.empty(2 * world, dtype=torch.int64)
        all_gather_single(every, torch.tensor([int(able), os.getpid()], dtype=torch.int64))
        self._link = next(ShmPeers._links)
        node_map = nodes.current()
        env = os.environ
        for q, (ok, pid) in enumerate(every.view(world, 2).tolist()):
            local = (node_map.within_one_node((self.rank, q)) if node_map is not None
                     else env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE") == str(world))
            if q != self.rank and able and ok and local:
                self._pids[q] = pid
        self._job = JOB_ID.read() or f"{env.get('MASTER_ADDR', 'local')}_{env.get('MASTER_PORT', '0')}"

    def reaches(self, peer: int) -> bool:
        """True when traffic with global rank `peer` goes over shared memory."""
        return peer in self._pids

    def channel(self, src: int, dst: int, tag: int) -> shm_comm.ShmChannel:
        """The channel src -> dst for `tag` (this rank is one end), opened on first use."""
        key = (src, dst, tag)
        found = self._channels.get(key)
        if found is None:
            peer = dst if src == self.rank else src
            found = shm_comm.ShmChannel(shm_comm.channel_name(self._job, self._link, src, dst, tag), self.rank,
                                        src, dst, tag, peer_pid=self._pids[peer])
            self._channels[key] = found
        return found

    def close(self) -> None:
        """Close every channel (queued sends fail: wait for them first)."""
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

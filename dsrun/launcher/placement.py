"""Placement: which global rank runs on which host, slot and device.

Ranks are numbered node-major: node 0 holds global ranks 0..n0-1, node 1 the
next n1, and so on, in hostfile order. Within a node, local rank i runs on
the i-th selected slot; with GPUs the slot index is the device index
(CUDA_VISIBLE_DEVICES lists the node's selected slots).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from dsrun.launcher.job import DEFAULT_HANG_TIMEOUT, NodeJob


@dataclass(frozen=True)
class NodePlacement:
    """The ranks of one node.

    Attributes:
        node_rank: index of the node in the job (0 = master node).
        host: host name as written in the hostfile / Slurm node list.
        slots: selected slot (device) indices; `slots[i]` serves local rank i.
        first_rank: global rank of local rank 0.
    """

    node_rank: int
    host: str
    slots: tuple[int, ...]
    first_rank: int

    @property
    def local_world_size(self) -> int:
        return len(self.slots)

    @property
    def global_ranks(self) -> list[int]:
        return list(range(self.first_rank, self.first_rank + len(self.slots)))


@dataclass(frozen=True)
class Placement:
    """All nodes of a job; `world_size` is the total number of ranks."""

    nodes: tuple[NodePlacement, ...]

    @property
    def world_size(self) -> int:
        return sum(n.local_world_size for n in self.nodes)

    @property
    def hosts(self) -> list[str]:
        return [n.host for n in self.nodes]


def build_placement(selection: dict[str, list[int]]) -> Placement:
    """Number the ranks of a selection (host -> slot indices, in node order).

    Raises:
        ValueError: the selection is empty or a host has no slot.
    """
    if not selection:
        raise ValueError("placement needs at least one host with one slot")
    nodes, first = [], 0
    for node_rank, (host, slots) in enumerate(selection.items()):
        if not slots:
            raise ValueError(f"host {host!r} has no slot selected")
        nodes.append(NodePlacement(node_rank, host, tuple(slots), first))
        first += len(slots)
    return Placement(tuple(nodes))


def node_jobs(placement: Placement, *, job_id: str, master_addr: str, master_port: int, command: list[str],
              cwd: str, env: dict[str, str], grace_period: float, pass_local_rank: bool, log_dir: str | None,
              visible_devices: bool, rendezvous_timeout: float,
              hang_timeout: float = DEFAULT_HANG_TIMEOUT, restart_count: int = 0) -> list[NodeJob]:
    """One `NodeJob` per node of `placement`, all sharing the rendezvous and the command.

    Args:
        env: variables every rank gets (see `dsrun.launcher.propagate`).
        visible_devices: set CUDA_VISIBLE_DEVICES to each node's selected
            slots, so local rank i uses slot `slots[i]` (hostfile launches
            over SSH; under Slurm the scheduler sets it, and a local launch
            keeps the CUDA_VISIBLE_DEVICES it inherits).
        rendezvous_timeout: seconds the ranks wait for each other at start.
        hang_timeout: seconds without a heartbeat before a rank is reported
            hung, 0 for none (see [Note: hung ranks] in hang.py).
        restart_count: restarts before this attempt (see dsrun/launcher/restart.py).
    """
    jobs = []
    for node in placement.nodes:
        node_env = dict(env)
        if visible_devices:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, node.slots))
        jobs.append(NodeJob(
            job_id=job_id, host=node.host, node_rank=node.node_rank, nnodes=len(placement.nodes),
            world_size=placement.world_size, ranks=node.global_ranks, local_ranks=list(range(node.local_world_size)),
            master_addr=master_addr, master_port=master_port, command=command, cwd=cwd, env=node_env,
            grace_period=grace_period, pass_local_rank=pass_local_rank, log_dir=log_dir,
            rendezvous_timeout=rendezvous_timeout, hang_timeout=hang_timeout, restart_count=restart_count,
        ))
    return jobs


def derived_port(key: str, index: int = 0) -> int:
    """A rendezvous port in 20000-32767 derived from `key` (a job id); `index` gives further candidates.

    Every process that knows the job id computes the same port without
    talking to the others, and two jobs rarely collide. The range ends
    below Linux's default ephemeral range (32768-60999), from which the
    kernel picks the local port of every outgoing connection: a derived
    port there could be held by one of them (or by one in TIME_WAIT) and
    rank 0's bind would fail with EADDRINUSE, as seen once under srun.
    """
    digest = hashlib.sha256(f"{key}/{index}".encode()).digest()
    return 20000 + int.from_bytes(digest[:8], "big") % 12768


def compact_ranges(values: Iterable[int]) -> str:
    """Write integers compactly: [0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    parts: list[str] = []
    i = 0
    vals = list(values)
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        parts.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(parts)


def placement_table(placement: Placement, master_addr: str | None = None) -> Table:
    """A rich table of the placement, for `--dry_run`."""
    title = f"dsrun placement: {len(placement.nodes)} node(s), world size {placement.world_size}"
    if master_addr:
        title += f", master {master_addr}"
    table = Table(title=title)
    for col in ("node rank", "host", "local ranks", "global ranks", "devices"):
        table.add_column(col)
    for n in placement.nodes:
        table.add_row(str(n.node_rank), n.host, compact_ranges(range(n.local_world_size)),
                      compact_ranges(n.global_ranks), compact_ranges(n.slots))
    return table


def print_placement(placement: Placement, console: Console, master_addr: str | None = None) -> None:
    """Print the placement table to `console`."""
    console.print(placement_table(placement, master_addr))

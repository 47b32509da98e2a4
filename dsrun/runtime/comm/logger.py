"""Counting what every collective sends: calls, elements and bytes per op.

Counters are always kept (a dict update per collective, far below the cost
of any collective), so tests and `engine.comm_stats()` can assert traffic
whether or not the user enabled DeepSpeed's `comms_logger`. The config only
decides what is *printed*: `verbose` prints one line per op as it is issued,
and `log_summary()` prints a table of the ops selected by `prof_all` /
`prof_ops`.

Byte accounting: the size of the full (unsharded) tensor an op works on --
the tensor for all_reduce/broadcast, the output for all_gather_into_tensor,
the input for reduce_scatter_tensor. That is DeepSpeed's "message size",
so the figures compare directly. `bus_bytes` is what this rank puts on
the wire under the bandwidth-optimal algorithm for the op, the "bus
bandwidth" convention of nccl-tests: message bytes times 2(p-1)/p for
all_reduce, (p-1)/p for all_gather, reduce_scatter and all_to_all, 1 for
broadcast, over a group of p ranks. That is the figure to compare across
ops (a compressed all-reduce built from an all-to-all and an all-gather
against a plain all_reduce).

[Note: intra-node and inter-node bytes]
Each collective's bus bytes are also attributed to one side of the node
boundary (dsrun/runtime/distributed/nodes.py says which node each rank is on): to
*intra-node* when every rank of its group is on one node, else to
*inter-node*, whole. That is the ZeRO++ paper's accounting (Wang et al.
2023, Section 2 and Table 1): a ZeRO-3 step moves M in the forward
all-gather, M in the backward all-gather and M in the gradient
reduce-scatter, 3M, all of it counted as cross-node when the group spans
nodes; hpZ (backward all-gather inside the node) takes it to 2M, qwZ's
int8 forward to 1.5M (bf16/fp16 weights), and qgZ's int4 gradients to
0.75M. It is an upper bound on what physically crosses the boundary: a
flat ring over k ranks per node crosses it on 1/k of its hops, a
hierarchical algorithm sends (nodes-1)/nodes of the message per node.
Without a node map (none learnt, see nodes.py) everything is intra-node.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from dsrun.runtime.distributed import nodes


@dataclasses.dataclass
class OpStats:
    """Totals for one op name since the last reset.

    Attributes:
        calls: number of collectives issued.
        elements: total elements (see module docstring for which tensor).
        bytes: total bytes = elements * element size.
        seconds: wall time of synchronous calls (async calls add 0: their
            cost shows up at wait()).
        wait_seconds: wall time the caller spent blocked in `wait()` on
            async calls (the part of their cost that overlap did not hide).
        bus_bytes: bytes this rank sends under the bandwidth-optimal
            algorithm (module docstring).
        transports: calls per transport that carried them ("shm" or
            "torch", see comm/collectives.py [Note: choosing the transport]).
        inter_node_bus_bytes: the part of bus_bytes sent by collectives
            whose group spans nodes; the rest is intra-node (see [Note:
            intra-node and inter-node bytes]).
    """

    calls: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    bus_bytes: int = 0
    transports: dict[str, int] = dataclasses.field(default_factory=dict)
    inter_node_bus_bytes: int = 0

    @property
    def intra_node_bus_bytes(self) -> int:
        """bus_bytes of collectives within one node."""
        return self.bus_bytes - self.inter_node_bus_bytes


# Bus bytes per message byte over p ranks (module docstring); ops not listed send nothing counted.
_BUS_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather_into_tensor": lambda p: (p - 1) / p,
    "reduce_scatter_tensor": lambda p: (p - 1) / p,
    "all_to_all_single": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0 if p > 1 else 0.0,
}


class CommsLogger:
    """Per-process collective counters plus optional printing.

    One instance per process (`comms_logger`, below): collectives are
    process-wide, so are their counts.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self._stats: dict[str, OpStats] = {}
        self._console = Console(stderr=True)

    def configure(self, enabled: bool, verbose: bool = False, prof_all: bool = True,
                  prof_ops: list[str] | None = None) -> None:
        """Apply DeepSpeed's `comms_logger` section (enabled, verbose, prof_all, prof_ops)."""
        self.enabled = enabled
        self.verbose = verbose
        self.prof_all = prof_all
        self.prof_ops = list(prof_ops or [])

    def record(self, op: str, tensor: torch.Tensor, seconds: float = 0.0,
               transport: str = "torch", group_size: int = 1, inter_node: bool = False) -> None:
        """Count one collective `op` over `tensor` (any shape/dtype), carried
        by `transport`, among `group_size` ranks; `inter_node`: its group
        spans nodes (see [Note: intra-node and inter-node bytes])."""
        stats = self._stats.setdefault(op, OpStats())
        numel = tensor.numel()
        stats.calls += 1
        stats.transports[transport] = stats.transports.get(transport, 0) + 1
        stats.elements += numel
        stats.bytes += numel * tensor.element_size()
        factor = _BUS_FACTOR.get(op)
        if factor is not None and group_size > 1:
            bus = round(numel * tensor.element_size() * factor(group_size))
            stats.bus_bytes += bus
            if inter_node:
                stats.inter_node_bus_bytes += bus
        stats.seconds += seconds
        if self.enabled and self.verbose and self._profiled(op):
            self._console.print(
                f"[comm] {op}: {numel} x {tensor.dtype} = {numel * tensor.element_size()} B"
                f" in {seconds * 1e3:.3f} ms")

    def record_wait(self, op: str, seconds: float) -> None:
        """Add `seconds` the caller blocked in `wait()` on an async `op` (see OpStats.wait_seconds)."""
        self._stats.setdefault(op, OpStats()).wait_seconds += seconds

    def totals(self) -> tuple[int, float]:
        """(bytes, seconds in collectives: synchronous calls plus waits) over every op so far."""
        return (sum(s.bytes for s in self._stats.values()),
                sum(s.seconds + s.wait_seconds for s in self._stats.values()))

    def inter_node_bus_bytes(self) -> int:
        """Bus bytes sent so far by collectives whose group spans nodes, every op."""
        return sum(s.inter_node_bus_bytes for s in self._stats.values())

    def _profiled(self, op: str) -> bool:
        return self.prof_all or op in self.prof_ops

    def snapshot(self) -> dict[str, OpStats]:
        """A copy of the counters, keyed by op name."""
        return {op: dataclasses.replace(s, transports=dict(s.transports)) for op, s in self._stats.items()}

    def reset(self) -> None:
        """Zero every counter."""
        self._stats.clear()

    def log_summary(self) -> None:
        """Print a table of the profiled ops on this process (only when enabled).

        Per op: calls, total MiB, average message size, seconds in
        synchronous calls and blocked in waits, and the algorithm and bus
        bandwidth over that time (GB/s; bus bandwidth as in nccl-tests,
        see the module docstring). With ranks on several nodes, a column
        for the bus MiB that crossed nodes ([Note: intra-node and
        inter-node bytes]).
        """
        if not self.enabled:
            return
        table = Table(title="collectives")
        node_map = nodes.current()
        several_nodes = node_map is not None and node_map.num_nodes > 1
        for col in ("op", "calls", "MiB", "avg msg KiB", "bus MiB", "inter-node bus MiB", "seconds (sync)",
                    "seconds (wait)", "algbw GB/s", "busbw GB/s"):
            if several_nodes or col != "inter-node bus MiB":
                table.add_column(col, justify="right" if col != "op" else "left")
        for op, s in sorted(self._stats.items()):
            if self._profiled(op):
                busy = s.seconds + s.wait_seconds
                inter = [f"{s.inter_node_bus_bytes / 2**20:.2f}"] if several_nodes else []
                table.add_row(op, str(s.calls), f"{s.bytes / 2**20:.2f}", f"{s.bytes / max(s.calls, 1) / 2**10:.1f}",
                              f"{s.bus_bytes / 2**20:.2f}", *inter, f"{s.seconds:.4f}", f"{s.wait_seconds:.4f}",
                              f"{s.bytes / busy / 1e9:.3f}" if busy else "-",
                              f"{s.bus_bytes / busy / 1e9:.3f}" if busy else "-")
        self._console.print(table)


comms_logger = CommsLogger()


class timed:
    """Context manager measuring wall seconds into `.seconds`."""

    def __enter__(self) -> "timed":
        self._t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's `deepspeed.comm.log_summary()`: print the collectives table on global rank 0.

    Prints only when the config's `comms_logger.enabled` is true (as
    DeepSpeed). Not collective: any rank may call it, rank 0 prints.

    Raises:
        ValueError: show_straggler=True (the per-rank straggler view is not
            built; the table shows rank 0's own figures).
    """
    if show_straggler:
        raise ValueError("log_summary(show_straggler=True) is not supported by dsrun; call log_summary()")
    if not dist.is_initialized() or dist.get_rank() == 0:
        comms_logger.log_summary()


"""ZeRO's collectives over flat, bucket-major buffers (see zero/partition.py).

Two operations, each over a *region* of consecutive buckets of a
`FlatLayout` (whole parameters, padded per bucket to a multiple of N):

- `reduce_scatter_region`: sum a full region (every rank's gradients) and
  leave each rank its shards, contiguous, in partition order;
- `all_gather_region`: rebuild the full region (parameter-major, so
  parameters are plain views) from every rank's shards.

[Note: choosing the collective per backend]
gloo's reduce_scatter_tensor and all_gather_into_tensor are about 2x slower
than its all_reduce on the same bytes (REFERENCE.md §6: 192 MiB fp32,
all_reduce 107-114 ms, reduce_scatter 242-253 ms, all_gather 234-236 ms;
re-measure with `bench/step_time/collectives.py`). So on gloo:
  reduce-scatter = all_reduce of the region, then keep the own shards;
  all-gather     = zero the region, write the own shards, all_reduce
                   (x + 0 + ... + 0 is exact, so the result is bit-exact).
Elsewhere (nccl, or gloo jobs served by the shared-memory transport of
collectives.py, whose native ops are cheap) the native collectives are used,
with a copy into / out of the rank-major order they require. Measured on a
loaded 2-core machine, 64 MiB fp32 (`bench/step_time/collectives.py`,
DSRUN_SHM_COMM=0): all_reduce 121 ms, reduce_scatter_tensor 256 ms,
all_gather_into_tensor 188 ms, region reduce-scatter 104 ms, region
all-gather 129 ms. Both are counted twice in the comms
logger: `comm.all_reduce` / native ops record what is ACTUALLY sent, and
`logical_reduce_scatter` / `logical_all_gather` record the ZeRO operation
(region elements), which is what the paper's Ψ accounting is about.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch.distributed import ProcessGroup

from dsrun.runtime.comm import collectives
from dsrun.runtime.comm.logger import comms_logger

if TYPE_CHECKING:  # the zero package imports this module; only the types are needed here
    from dsrun.runtime.zero.partition import BucketSlot, FlatLayout

LOGICAL_REDUCE_SCATTER = "logical_reduce_scatter"
LOGICAL_ALL_GATHER = "logical_all_gather"


def _uses_all_reduce(group: ProcessGroup | None) -> bool:
    """True when the backend's all_reduce beats its reduce-scatter/all-gather.
    See [Note: choosing the collective per backend]; shared memory (on one
    node, collectives.uses_shm) has fast native ones."""
    import torch.distributed as dist

    return dist.get_backend(group) == "gloo" and not collectives.uses_shm(group)


class RegionHandle:
    """Result of an async region collective: `wait()` blocks until the
    output is complete (it also runs the local copy-out that follows)."""

    def __init__(self, work, finish):
        self._work = work
        self._finish = finish

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()  # blocks on the collective
            self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None


def _region(buckets: Sequence[BucketSlot]) -> tuple[int, int]:
    start = buckets[0].offset
    end = buckets[-1].offset + buckets[-1].padded_numel
    return start, end


def _shard_spans(layout: FlatLayout, buckets: Sequence[BucketSlot], rank: int):
    """(region offset of rank's shard, shard offset in the output, width) per bucket."""
    base = buckets[0].offset
    for b in buckets:
        w = layout.bucket_shard_numel(b)
        yield b.offset - base + rank * w, (b.offset - base) // layout.world_size, w


def reduce_scatter_region(layout: FlatLayout, buckets: Sequence[BucketSlot], full: torch.Tensor,
                          out: torch.Tensor, rank: int, group: ProcessGroup | None = None,
                          async_op: bool = False) -> RegionHandle:
    """Sum `full` over ranks; this rank's shards land in `out`.

    full: the region of a full flat buffer, shape (region elements,), any
    float dtype; its content is clobbered. out: shape (region / N,), same
    dtype; receives the SUM (callers divide by N). buckets: consecutive
    buckets of `layout`. Returns a handle (already complete unless async_op).
    """
    start, end = _region(buckets)
    if full.numel() != end - start or out.numel() * layout.world_size != full.numel():
        raise ValueError(f"region of {end - start} elements needs full ({full.numel()}) and "
                         f"out x world_size ({out.numel()} x {layout.world_size}) of that size")
    comms_logger.record(LOGICAL_REDUCE_SCATTER, full)
    if layout.world_size == 1:
        out.copy_(full)
        return RegionHandle(None, None)
    if _uses_all_reduce(group):
        work = collectives.all_reduce(full, group=group, async_op=True)

        def finish():
            for src, dst, w in _shard_spans(layout, buckets, rank):
                out[dst:dst + w].copy_(full[src:src + w])
    else:
        # rank-major copy-in: the native op wants rank r's slice contiguous.
        staged = torch.empty_like(full)
        for r in range(layout.world_size):
            for src, dst, w in _shard_spans(layout, buckets, r):
                staged[r * out.numel() + dst:r * out.numel() + dst + w].copy_(full[src:src + w])
        work = collectives.reduce_scatter_tensor(out, staged, group=group, async_op=True)
        finish = None
    handle = RegionHandle(work, finish)
    if not async_op:
        handle.wait()
    return handle


def all_gather_region(layout: FlatLayout, buckets: Sequence[BucketSlot], full: torch.Tensor,
                      rank: int, group: ProcessGroup | None = None,
                      async_op: bool = False) -> RegionHandle:
    """Complete a full region from every rank's shards, in place.

    full: shape (region elements,), any dtype, parameter-major (the layout's
    views apply). On entry it must hold this rank's shards at their own
    positions (see `own_shard_views`); everything else is overwritten.
    """
    start, end = _region(buckets)
    if full.numel() != end - start:
        raise ValueError(f"region of {end - start} elements, got a buffer of {full.numel()}")
    comms_logger.record(LOGICAL_ALL_GATHER, full)
    if layout.world_size == 1:
        return RegionHandle(None, None)
    if _uses_all_reduce(group):
        for r in range(layout.world_size):
            if r != rank:
                for src, _, w in _shard_spans(layout, buckets, r):
                    full[src:src + w].zero_()
        work = collectives.all_reduce(full, group=group, async_op=True)
        finish = None
    else:
        n = full.numel() // layout.world_size
        mine = torch.empty(n, dtype=full.dtype, device=full.device)
        for src, dst, w in _shard_spans(layout, buckets, rank):
            mine[dst:dst + w].copy_(full[src:src + w])
        gathered = torch.empty_like(full)
        work = collectives.all_gather_into_tensor(gathered, mine, group=group, async_op=True)

        def finish():
            for r in range(layout.world_size):
                for src, dst, w in _shard_spans(layout, buckets, r):
                    full[src:src + w].copy_(gathered[r * n + dst:r * n + dst + w])
    handle = RegionHandle(work, finish)
    if not async_op:
        handle.wait()
    return handle


def own_shard_views(layout: FlatLayout, buckets: Sequence[BucketSlot], full: torch.Tensor,
                    rank: int) -> list[tuple[torch.Tensor, int]]:
    """(view of `full` at rank's shard of each bucket, its offset in the
    rank's shards of the region), in bucket order."""
    return [(full[src:src + w], dst) for src, dst, w in _shard_spans(layout, buckets, rank)]

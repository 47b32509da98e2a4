"""ZeRO's collectives over flat, bucket-major buffers (see partition.py).

Two operations over a *region* (consecutive buckets of a `FlatLayout`,
whole parameters, each bucket padded to a multiple of the shard size),
both issued through `dsrun.runtime.comm` (the only module that calls
torch.distributed):

- `reduce_region`: sum a full region over the shard group, leaving each
  rank its shards (contiguous, partition order), then sum those over the
  replicate group (see groups.py);
- `all_gather_region`: rebuild the full region (parameter-major, so
  parameters are plain views) from every rank's shards, in place.

Neither allocates a second full-size buffer. Within one bucket the shards
are already rank-major (shard r = [offset + r*w, offset + (r+1)*w)), which
is what the native reduce-scatter and all-gather take, so they run per
bucket in place; rank r's shard of the output may alias its input (shm and
NCCL allow both in-place forms).

[Note: choosing the collective per backend]
gloo's reduce_scatter_tensor and all_gather_into_tensor are about 2x slower
than its all_reduce on the same bytes (REFERENCE.md §6: 192 MiB fp32,
all_reduce 107-114 ms, reduce_scatter 242-253 ms, all_gather 234-236 ms;
re-measure with `bench/step_time/collectives.py`). So on gloo:
  reduce-scatter = all_reduce of the region, then keep the own shards;
  all-gather     = zero the region, write the own shards, all_reduce
                   (x + 0 + ... + 0 is exact, so the result is bit-exact).
Elsewhere (nccl, or gloo jobs served by the shared-memory transport, whose
native ops are cheap) the native collectives run per bucket. Both are
counted twice in the comms logger: `comm.all_reduce` / the native ops
record what is ACTUALLY sent, and `logical_reduce_scatter` /
`logical_all_gather` record the ZeRO operation (region elements), which is
what the paper's Ψ accounting is about.

[Note: overlapped regions]
With async_op=True the per-bucket reduce-scatters (all-gathers) of one
region go out as ONE overlapped batch (`comm.collectives.overlapped_reduce_scatter`
/ `overlapped_all_gather`): where shared memory serves the group they run
on the communication thread, in issue order, while the caller computes
(stages 1-2: backward goes on while a bucket is reduced; stage 3: the
next unit's gather and the last unit's gradients travel during compute),
and the handle's `wait()` is where the caller blocks and where an error
surfaces. The region's buffers must not be touched until then, which the
callers guarantee (the reducer's staging and outputs, a GATHERING unit's
`full`). Synchronous calls (async_op=False) run the collectives inline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dsrun.runtime.comm import collectives
from dsrun.runtime.comm import quantized
from dsrun.runtime.comm.hierarchical import quantized_reduce_scatter
from dsrun.runtime.comm.logger import comms_logger
from dsrun.runtime.zero.groups import NodeGroups, RankGroup, ZeroGroups
from dsrun.runtime.zero.partition import BucketSlot, FlatLayout

LOGICAL_REDUCE_SCATTER = "logical_reduce_scatter"
LOGICAL_ALL_GATHER = "logical_all_gather"


def uses_all_reduce(group: RankGroup) -> bool:
    """True when the backend's all_reduce beats its reduce-scatter/all-gather.
    See [Note: choosing the collective per backend]; shared memory (one node,
    collectives.uses_shm) has fast native ones."""
    return dist.get_backend(group.group) == "gloo" and not collectives.uses_shm(group.group)


@dataclass(frozen=True)
class GradientQuantization:
    """ZeRO++ qgZ for `reduce_region`: the shard group's ranks as a grid of
    `nodes` (intra x inter; shard rank = inter.rank * intra.size +
    intra.rank), gradients sent as int4 in blocks of `block` elements
    (comm/hierarchical.py)."""

    nodes: NodeGroups
    block: int


class RegionHandle:
    """Result of an async region collective: `wait()` blocks until the
    output is complete (it also runs whatever local step follows)."""

    def __init__(self, works: list, finish: Callable[[], None] | None = None):
        self._works = works
        self._finish = finish

    def wait(self) -> None:
        for work in self._works:
            work.wait()  # blocks on the collective
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def _relative_spans(layout: FlatLayout, buckets: Sequence[BucketSlot], rank: int):
    """(region offset of rank's shard, offset in the region's shards, width) per bucket."""
    start, _ = layout.region(buckets)
    part_start = layout.bucket_shard_offset(buckets[0])
    return [(src - start, dst - part_start, w) for src, dst, w in layout.shard_spans(rank, buckets)]


def _check(layout: FlatLayout, buckets: Sequence[BucketSlot], full: torch.Tensor,
           shard: RankGroup) -> None:
    start, end = layout.region(buckets)
    if full.numel() != end - start:
        raise ValueError(f"region of {end - start} elements, got a buffer of {full.numel()}")
    if layout.world_size != shard.size:
        raise ValueError(f"layout over {layout.world_size} ranks used with a shard group of {shard.size}")


def reduce_region(layout: FlatLayout, buckets: Sequence[BucketSlot], full: torch.Tensor,
                  out: torch.Tensor, groups: ZeroGroups, async_op: bool = False,
                  quantize: GradientQuantization | None = None) -> RegionHandle:
    """Sum `full` over all data-parallel ranks; this rank's shards land in `out`.

    full: the region of a full flat buffer, shape (region elements,), any
    float dtype; clobbered. out: shape (region / shard size,), same dtype,
    may be `full` itself when the shard group is one rank, or (one bucket)
    this rank's shard of `full`. Receives the SUM over shard x replicate
    ranks; callers divide. Returns a handle (already complete unless async_op).
    quantize: ZeRO++ qgZ: the shard group's reduce-scatter is the
    hierarchical int4 all-to-all of comm/hierarchical.py, each bucket one
    rank-major segment (the sum is then approximate, see there).

    Raises ValueError when the sizes do not match the layout.
    """
    _check(layout, buckets, full, groups.shard)
    if out.numel() * layout.world_size != full.numel():
        raise ValueError(f"out has {out.numel()} elements, the region's shards {full.numel() // layout.world_size}")
    comms_logger.record(LOGICAL_REDUCE_SCATTER, full)
    shard, replicate = groups.shard, groups.replicate
    works, finish = [], None
    if shard.size == 1:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full)
    elif quantize is not None:
        base = buckets[0].offset
        segments = [full[b.offset - base:b.offset - base + b.padded_numel] for b in buckets]
        works.append(quantized_reduce_scatter(segments, out, quantize.nodes.intra, quantize.nodes.inter,
                                              quantize.block, async_op=True))
    elif uses_all_reduce(shard):
        works.append(collectives.all_reduce(full, group=shard.group, async_op=True))

        def finish():
            for src, dst, w in _relative_spans(layout, buckets, shard.rank):
                if out[dst:].data_ptr() != full[src:].data_ptr():  # else reduced in place already
                    out[dst:dst + w].copy_(full[src:src + w])
    else:
        base = buckets[0].offset
        pairs = [(out[dst:dst + w], full[b.offset - base:b.offset - base + b.padded_numel])
                 for b, (_, dst, w) in zip(buckets, _relative_spans(layout, buckets, shard.rank))]
        if async_op:  # on the communication thread where shm serves: see [Note: overlapped regions]
            works.append(collectives.overlapped_reduce_scatter(pairs, group=shard.group))
        else:
            for o, i in pairs:
                collectives.reduce_scatter_tensor(o, i, group=shard.group)
    if replicate.size > 1:
        RegionHandle(works, finish).wait()  # the replicas sum what the shard group reduced
        works, finish = [collectives.all_reduce(out, group=replicate.group, async_op=True)], None
    handle = RegionHandle(works, finish)
    if not async_op:
        handle.wait()
    return handle


def all_gather_region(layout: FlatLayout, buckets: Sequence[BucketSlot], full: torch.Tensor,
                      shard: RankGroup, async_op: bool = False, quantize_block: int = 0,
                      message: torch.Tensor | None = None) -> RegionHandle:
    """Complete a full region from every shard-group rank's shards, in place.

    full: shape (region elements,), any dtype, parameter-major (the layout's
    views apply). On entry it must hold this rank's shards at their own
    positions (see `own_shard_views`); everything else is overwritten.
    quantize_block > 0: ZeRO++ qwZ, see `_all_gather_quantized`.
    message: this rank's shards of the region already quantized (int8,
    `quantized.pack_message` of them in blocks of quantize_block, e.g. the
    int8 frozen shards of flat_params.py): sent as they are, and `full`
    need not hold them on entry.
    Raises ValueError when the sizes do not match the layout, or for a
    message without a quantize_block.
    """
    _check(layout, buckets, full, shard)
    comms_logger.record(LOGICAL_ALL_GATHER, full)
    if message is not None and quantize_block < 1:
        raise ValueError("a pre-quantized message needs its quantize_block")
    if shard.size == 1 and message is None:
        return RegionHandle([])
    if quantize_block > 0:
        handle = _all_gather_quantized(layout, buckets, full, shard, quantize_block, message)
        if not async_op:
            handle.wait()
        return handle
    works = []
    if uses_all_reduce(shard):
        for r in range(shard.size):
            if r != shard.rank:
                for src, _, w in _relative_spans(layout, buckets, r):
                    full[src:src + w].zero_()
        works.append(collectives.all_reduce(full, group=shard.group, async_op=True))
    else:
        base = buckets[0].offset
        pairs = [(full[b.offset - base:b.offset - base + b.padded_numel], full[src:src + w])
                 for b, (src, _, w) in zip(buckets, _relative_spans(layout, buckets, shard.rank))]
        if async_op:  # see [Note: overlapped regions]
            works.append(collectives.overlapped_all_gather(pairs, group=shard.group))
        else:
            for o, i in pairs:
                collectives.all_gather_into_tensor(o, i, group=shard.group)
    handle = RegionHandle(works)
    if not async_op:
        handle.wait()
    return handle


def _all_gather_quantized(layout: FlatLayout, buckets: Sequence[BucketSlot], full: torch.Tensor,
                          shard: RankGroup, block: int, message: torch.Tensor | None = None) -> RegionHandle:
    """ZeRO++ qwZ: every rank sends its shards of the region as block-wise
    int8 with fp32 scales (dsrun/runtime/comm/quantized.py) in one
    all-gather; `wait()` decodes every rank's shards, this rank's too, so
    all ranks compute with the same (quantized) weights. The partitions and
    master weights are untouched: only this gathered copy is approximate.
    message: the rank's shards already quantized (see `all_gather_region`)."""
    own = _relative_spans(layout, buckets, shard.rank)
    width = sum(w for _, _, w in own)  # the same on every rank: buckets are padded to the shard size
    if message is None:
        message = quantized.pack_message(torch.cat([full[src:src + w] for src, _, w in own]), block)
    elif message.dtype != torch.int8 or message.numel() != quantized.message_numel(width, block):
        raise ValueError(f"a quantized message of {width} values in blocks of {block} has "
                         f"{quantized.message_numel(width, block)} int8 elements, got {message.numel()} "
                         f"{message.dtype}")
    if shard.size == 1:
        gathered, works = message, []
    else:
        gathered = torch.empty(shard.size * message.numel(), dtype=torch.int8, device=full.device)
        works = [collectives.all_gather_into_tensor(gathered, message, group=shard.group, async_op=True)]

    def finish() -> None:
        for r, row in enumerate(gathered.view(shard.size, -1)):
            decoded = quantized.unpack_message(row, width, block, full.dtype)
            at = 0
            for src, _, w in _relative_spans(layout, buckets, r):
                full[src:src + w].copy_(decoded[at:at + w])
                at += w
    return RegionHandle(works, finish)


def own_shard_views(layout: FlatLayout, buckets: Sequence[BucketSlot], full: torch.Tensor,
                    rank: int) -> list[tuple[torch.Tensor, int]]:
    """(view of the region buffer `full` at rank's shard of each bucket, its
    offset among the rank's shards of the region), in bucket order."""
    return [(full[src:src + w], dst) for src, dst, w in _relative_spans(layout, buckets, rank)]

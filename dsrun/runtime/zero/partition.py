"""Flat, padded, partitioned layout of a group of parameters.

ZeRO keeps every parameter group as one flat, contiguous buffer so that a
whole bucket moves with one collective instead of one per tensor. This module
holds the layout only (who lives where) plus the few tensor helpers that
follow from it; it issues no collectives.

[Note: bucket-major partitioning]
A group is cut into buckets of whole parameters (at most `bucket_numel`
elements each, a larger parameter gets a bucket to itself). Each bucket is
padded with zeros to a multiple of the world size N and split into N equal
shards; rank r owns shard r of EVERY bucket. A bucket can therefore be
reduce-scattered or all-gathered with one equal-split collective as soon as
its gradients are ready, which a single [r*P, (r+1)*P) cut of the whole group
cannot offer (a bucket would straddle owners unevenly). A rank's partition of
the group is the concatenation of its shards, in bucket order; because every
bucket offset is a multiple of N, bucket b's shard starts at
`bucket.offset // N` inside the partition.

Padding is zero, is never visible through a parameter view, and is dropped by
`local_pieces`, which is what checkpoints and `safe_get_full_*` use: each
piece says which elements of which parameter a rank holds and where.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Iterable, Sequence

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat group.

    index: position of the parameter in the group; name: its qualified name
    (for messages and checkpoints); shape/numel: the parameter's own shape;
    bucket: index of its bucket; offset: first element in the group's padded
    flat space (elements, not bytes).
    """

    index: int
    name: str
    shape: tuple[int, ...]
    numel: int
    bucket: int
    offset: int


@dataclass(frozen=True)
class BucketSlot:
    """One bucket: `numel` real elements starting at `offset` in the flat
    space, padded to `padded_numel` (a multiple of the world size)."""

    index: int
    offset: int
    numel: int
    padded_numel: int


@dataclass(frozen=True)
class LocalPiece:
    """Elements [lo, hi) of parameter `slot` (flattened) are held by this rank
    at [shard_offset, shard_offset + hi - lo) of its partition."""

    slot: ParamSlot
    lo: int
    hi: int
    shard_offset: int


class FlatLayout:
    """The layout of one parameter group over `world_size` ranks.

    Build with `FlatLayout.build(named_shapes, world_size, bucket_numel)`.
    All sizes are element counts. Raises ValueError for an empty group, a
    non-positive world size or bucket size.
    """

    def __init__(self, slots: Sequence[ParamSlot], buckets: Sequence[BucketSlot], world_size: int):
        self.slots = tuple(slots)
        self.buckets = tuple(buckets)
        self.world_size = world_size

    @classmethod
    def build(
        cls,
        named_shapes: Iterable[tuple[str, Sequence[int]]],
        world_size: int,
        bucket_numel: int | None = None,
        keys: Sequence[object] | None = None,
    ) -> "FlatLayout":
        """Lay out parameters in the given order.

        named_shapes: (name, shape) per parameter. bucket_numel: most real
        elements per bucket; None puts the whole group in one bucket.
        keys: optional key per parameter (e.g. its optimizer group); a new
        bucket starts whenever the key changes, so a bucket never mixes keys.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
        entries = [(name, tuple(int(d) for d in shape)) for name, shape in named_shapes]
        if not entries:
            raise ValueError("cannot lay out an empty parameter group")
        # Group parameters into buckets of whole parameters.
        keys = list(keys) if keys is not None else [None] * len(entries)
        if len(keys) != len(entries):
            raise ValueError(f"{len(keys)} keys for {len(entries)} parameters")
        groups: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
        filled = 0
        for i, (name, shape) in enumerate(entries):
            numel = 1
            for d in shape:
                numel *= d
            full = bucket_numel is not None and filled + numel > bucket_numel
            if groups[-1] and (full or keys[i] != keys[i - 1]):
                groups.append([])
                filled = 0
            groups[-1].append((name, shape, numel))
            filled += numel
        slots: list[ParamSlot] = []
        buckets: list[BucketSlot] = []
        base = 0
        for b, members in enumerate(groups):
            cursor = base
            for name, shape, numel in members:
                slots.append(ParamSlot(len(slots), name, shape, numel, b, cursor))
                cursor += numel
            real = cursor - base
            padded = -(-max(real, 1) // world_size) * world_size
            buckets.append(BucketSlot(b, base, real, padded))
            base += padded
        return cls(slots, buckets, world_size)

    # ---- sizes (a layout never changes: computed once) -----------------
    @cached_property
    def numel(self) -> int:
        """Real elements in the group (no padding)."""
        return sum(s.numel for s in self.slots)

    @cached_property
    def padded_numel(self) -> int:
        """Elements of the full flat buffer, padding included."""
        return sum(b.padded_numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's partition (padding included)."""
        return self.padded_numel // self.world_size

    def bucket_shard_numel(self, bucket: BucketSlot) -> int:
        return bucket.padded_numel // self.world_size

    def bucket_shard_offset(self, bucket: BucketSlot) -> int:
        """Where bucket's shard starts inside a rank's partition."""
        return bucket.offset // self.world_size

    def slots_of_bucket(self, bucket: int) -> list[ParamSlot]:
        return [s for s in self.slots if s.bucket == bucket]

    def region(self, buckets: Sequence[BucketSlot]) -> tuple[int, int]:
        """[start, end) in the full flat space of consecutive `buckets`."""
        return buckets[0].offset, buckets[-1].offset + buckets[-1].padded_numel

    def shard_spans(self, rank: int,
                    buckets: Sequence[BucketSlot] | None = None) -> list[tuple[int, int, int]]:
        """Where rank's shard of each bucket lives, in bucket order.

        Returns (offset in the full flat space, offset in rank's partition,
        width) per bucket of `buckets` (default: all). Every other module
        asks here instead of recomputing shard offsets.
        """
        out = []
        for b in self.buckets if buckets is None else buckets:
            w = self.bucket_shard_numel(b)
            out.append((b.offset + rank * w, self.bucket_shard_offset(b), w))
        return out

    # ---- ownership -----------------------------------------------------
    def local_pieces(self, rank: int) -> list[LocalPiece]:
        """The parameter elements held by `rank`, in partition order.

        Padding is never part of a piece. Raises ValueError for a rank
        outside [0, world_size).
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        pieces = []
        for slot in self.slots:
            bucket = self.buckets[slot.bucket]
            width = self.bucket_shard_numel(bucket)
            own_lo = bucket.offset + rank * width
            own_hi = own_lo + width
            lo = max(slot.offset, own_lo)
            hi = min(slot.offset + slot.numel, own_hi)
            if lo < hi:
                shard_offset = self.bucket_shard_offset(bucket) + (lo - own_lo)
                pieces.append(LocalPiece(slot, lo - slot.offset, hi - slot.offset, shard_offset))
        return pieces

    def to_dict(self) -> dict:
        """JSON-ready description (for checkpoint metadata)."""
        return {
            "world_size": self.world_size,
            "slots": [dict(asdict(s), shape=list(s.shape)) for s in self.slots],
            "buckets": [asdict(b) for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "FlatLayout":
        slots = [ParamSlot(**dict(s, shape=tuple(s["shape"]))) for s in data["slots"]]
        buckets = [BucketSlot(**b) for b in data["buckets"]]
        return cls(slots, buckets, int(data["world_size"]))

    def __repr__(self) -> str:
        return (f"FlatLayout(params={len(self.slots)}, buckets={len(self.buckets)}, "
                f"numel={self.numel}, padded={self.padded_numel}, world_size={self.world_size})")


# ---- tensor helpers ----------------------------------------------------

def flatten_into(layout: FlatLayout, tensors: Sequence[torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """A new zero-padded flat buffer, shape (padded_numel,), holding `tensors`
    (one per slot, any dtype, cast to `dtype`). Raises ValueError when a
    tensor's shape does not match its slot."""
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for slot, t in zip(layout.slots, tensors, strict=True):
        if tuple(t.shape) != slot.shape:
            raise ValueError(f"parameter {slot.name!r}: shape {tuple(t.shape)} does not match "
                             f"the layout's {slot.shape}")
        flat[slot.offset:slot.offset + slot.numel].copy_(t.detach().reshape(-1))
    return flat


def param_views(layout: FlatLayout, flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of a full flat buffer (padded_numel,) with each parameter's shape."""
    return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots]


def bucket_view(flat: torch.Tensor, bucket: BucketSlot) -> torch.Tensor:
    """The padded bucket region (padded_numel,) of a full flat buffer."""
    return flat[bucket.offset:bucket.offset + bucket.padded_numel]


def shard_of(layout: FlatLayout, partition: torch.Tensor, bucket: BucketSlot) -> torch.Tensor:
    """Bucket's shard (padded_numel / N,) inside a rank's partition (shard_numel,)."""
    start = layout.bucket_shard_offset(bucket)
    return partition[start:start + layout.bucket_shard_numel(bucket)]


def extract_partition(layout: FlatLayout, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """Copy rank's shards of a full flat buffer into a new partition tensor
    (shard_numel,), same dtype."""
    part = torch.empty(layout.shard_numel, dtype=flat.dtype, device=flat.device)
    for b in layout.buckets:
        w = layout.bucket_shard_numel(b)
        shard_of(layout, part, b).copy_(flat[b.offset + rank * w:b.offset + (rank + 1) * w])
    return part


def gather_param(layout: FlatLayout, slot: ParamSlot, partitions: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rebuild one parameter (its shape, partitions' dtype) from every rank's
    partition, given in rank order."""
    out = torch.empty(slot.numel, dtype=partitions[0].dtype, device=partitions[0].device)
    for rank, part in enumerate(partitions):
        for piece in layout.local_pieces(rank):
            if piece.slot.index == slot.index:
                out[piece.lo:piece.hi].copy_(part[piece.shard_offset:piece.shard_offset + piece.hi - piece.lo])
    return out.view(slot.shape)

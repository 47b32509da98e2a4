"""Flat layout: padding, ownership, round trips (no processes needed)."""
import pytest
import torch

from dsrun.runtime.zero.partition import (FlatLayout, extract_partition, flatten_into,
                                          gather_param, param_views, shard_of)

SHAPES = [("a", (3, 5)), ("b", (7,)), ("c", (2, 2, 2)), ("d", (1,)), ("e", (11, 3))]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [None, 16, 1])
def test_layout_sizes_and_padding(world_size, bucket):
    layout = FlatLayout.build(SHAPES, world_size, bucket)
    assert layout.numel == 15 + 7 + 8 + 1 + 33
    for b in layout.buckets:
        assert b.padded_numel % world_size == 0 and b.offset % world_size == 0
        assert b.numel <= b.padded_numel < b.numel + world_size
        members = layout.slots_of_bucket(b.index)
        assert sum(s.numel for s in members) == b.numel
    assert layout.shard_numel * world_size == layout.padded_numel
    if bucket == 1:  # every parameter alone in its bucket
        assert len(layout.buckets) == len(SHAPES)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_pieces_cover_every_element_once(world_size):
    layout = FlatLayout.build(SHAPES, world_size, 20)
    tensors = [torch.randn(s) for _, s in SHAPES]
    flat = flatten_into(layout, tensors, torch.float32)
    parts = [extract_partition(layout, flat, r) for r in range(world_size)]
    covered = {s.index: torch.zeros(s.numel, dtype=torch.int32) for s in layout.slots}
    for r in range(world_size):
        for p in layout.local_pieces(r):
            covered[p.slot.index][p.lo:p.hi] += 1
            got = parts[r][p.shard_offset:p.shard_offset + p.hi - p.lo]
            assert torch.equal(got, tensors[p.slot.index].reshape(-1)[p.lo:p.hi])
    assert all(bool((c == 1).all()) for c in covered.values())
    for slot, t in zip(layout.slots, tensors):
        assert torch.equal(gather_param(layout, slot, parts), t)


def test_padding_never_leaks_into_views():
    layout = FlatLayout.build(SHAPES, 4, None)
    flat = flatten_into(layout, [torch.ones(s) for _, s in SHAPES], torch.bfloat16)
    assert flat.dtype == torch.bfloat16
    assert float(flat.sum()) == layout.numel  # padding is zero
    views = param_views(layout, flat)
    assert [tuple(v.shape) for v in views] == [s for _, s in SHAPES]
    views[0].fill_(2)  # a view writes through to the flat buffer
    assert float(flat[:15].sum()) == 30
    part = extract_partition(layout, flat, 3)
    assert torch.equal(shard_of(layout, part, layout.buckets[0]), part)


def test_dict_round_trip_and_errors():
    layout = FlatLayout.build(SHAPES, 3, 10)
    again = FlatLayout.from_dict(layout.to_dict())
    assert again.slots == layout.slots and again.buckets == layout.buckets
    with pytest.raises(ValueError, match="empty"):
        FlatLayout.build([], 2)
    with pytest.raises(ValueError, match="rank 5"):
        layout.local_pieces(5)
    with pytest.raises(ValueError, match="shape"):
        flatten_into(layout, [torch.zeros(1)] * 5, torch.float32)

"""Region reduce-scatter / all-gather over bucket-major layouts, both ways of
doing them: gloo's all_reduce-based path and the native path (used on nccl;
gloo implements the native ops too, so both run here)."""
import pytest
import torch

from tests.dist_helpers import run_ranks

SHAPES = [("a", (5, 3)), ("b", (7,)), ("c", (4, 4)), ("d", (3,))]


def _regions(native: bool):
    import dsrun
    from dsrun.runtime.zero import collectives as zc
    from dsrun.runtime.zero.groups import RankGroup, ZeroGroups
    from dsrun.runtime.zero.partition import FlatLayout, extract_partition, flatten_into

    dsrun.init_distributed()
    if native:
        zc.uses_all_reduce = lambda group: False
    rank, world = dsrun.comm.get_rank(), dsrun.comm.get_world_size()
    layout = FlatLayout.build(SHAPES, world, 20)
    per_rank = [[torch.full(s, float(r + 1)) * torch.arange(1, 1 + torch.Size(s).numel()).view(s)
                 for _, s in SHAPES] for r in range(world)]
    full = flatten_into(layout, per_rank[rank], torch.float32)
    expected_sum = sum(flatten_into(layout, ts, torch.float32) for ts in per_rank)
    out = torch.empty(layout.shard_numel)
    b = layout.buckets
    groups = ZeroGroups.sharded()
    zc.reduce_region(layout, b[1:], full[b[1].offset:], out[b[1].offset // world:], groups)
    zc.reduce_region(layout, b[:1], full[:b[0].padded_numel], out[:b[0].padded_numel // world], groups)
    rs_ok = torch.equal(out, extract_partition(layout, expected_sum, rank))
    # All-gather: start from the own shards only (garbage elsewhere).
    target = flatten_into(layout, per_rank[0], torch.float32)
    buf = torch.full((layout.padded_numel,), -7.0)
    for view, dst in zc.own_shard_views(layout, b, buf, rank):
        view.copy_(extract_partition(layout, target, rank)[dst:dst + view.numel()])
    zc.all_gather_region(layout, b, buf, RankGroup.of())
    return rs_ok, torch.equal(buf, target), len(b)


@pytest.mark.parametrize("native", [False, True])
def test_region_collectives(native):
    for rs_ok, ag_ok, nb in run_ranks(_regions, 2, native, timeout=120):
        assert nb > 1 and rs_ok and ag_ok

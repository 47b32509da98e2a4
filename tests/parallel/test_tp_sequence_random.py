"""Dropout RNG in Megatron sequence-parallel regions (see [Note: dropout in
tensor-parallel regions] in dsrun/runtime/parallel/tensor/random.py), on 2
gloo ranks on the CPU: after `model_parallel_cuda_manual_seed`, draws after
`scatter_to_sequence_region`, between sequence-parallel column and row
layers, after the row layer's reduce-scatter and after a sequence-parallel
VocabParallelEmbedding differ across the model ranks; after the exit
(`gather_from_sequence_region(..., reduce_grads=False)`) they are the same on
both ranks and are what the default generator gives had the regions drawn
nothing; without the seed every draw is the same on both ranks.
"""
from __future__ import annotations

import torch

from tests.dist_helpers import run_ranks


def _draws(seeded: bool) -> dict:
    import dsrun
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    from dsrun.runtime.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from dsrun.runtime.parallel.tensor.mappings import gather_from_sequence_region, scatter_to_sequence_region
    from dsrun.runtime.parallel.tensor.random import in_split_region
    tracker, seed = dsrun.checkpointing.get_cuda_rng_tracker, dsrun.checkpointing.model_parallel_cuda_manual_seed
    dsrun.init_distributed()
    mesh = ParallelMesh.build(torch.distributed.get_world_size(), model=2)
    set_current(mesh)
    group = mesh.axis_group("model")
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 16, sequence_parallel=True)
    row = RowParallelLinear(16, 8, sequence_parallel=True)
    emb = VocabParallelEmbedding(10, 8, sequence_parallel=True)
    x = torch.randn(4, 2, 8)  # (s, b, h), the same on both ranks
    ids = torch.arange(8).view(4, 2)
    tracker().reset()
    if seeded:
        seed(123)  # also seeds the default generator with 123
    expected = torch.get_rng_state()
    out = {}
    xs = scatter_to_sequence_region(x, group)
    out["after_scatter"] = torch.rand(16)
    h = col(xs)
    out["between_col_and_row"] = torch.rand(16)
    y = row(h)
    out["after_row"] = torch.rand(16)
    full = gather_from_sequence_region(y, group, reduce_grads=False)
    out["open_after_exit"] = in_split_region()
    out["after_exit"] = torch.rand(16)
    emb(ids)
    out["after_embedding"] = torch.rand(16)
    gather_from_sequence_region(full[:2], group, reduce_grads=False)
    out["after_second_exit"] = torch.rand(16)
    torch.set_rng_state(expected)
    out["default"] = torch.rand(32)
    return out


SPLIT = ("after_scatter", "between_col_and_row", "after_row", "after_embedding")


def test_sequence_parallel_regions_draw_per_rank():
    r0, r1 = run_ranks(_draws, 2, True, timeout=120)
    for key in SPLIT:
        assert not torch.equal(r0[key], r1[key]), key
    assert not r0["open_after_exit"] and not r1["open_after_exit"]
    for r in (r0, r1):  # the replicated draws continue the default stream
        assert torch.equal(torch.cat([r["after_exit"], r["after_second_exit"]]), r["default"])
    assert torch.equal(r0["default"], r1["default"])


def test_without_the_seed_every_rank_draws_alike():
    r0, r1 = run_ranks(_draws, 2, False, timeout=120)
    for key in (*SPLIT, "after_exit", "after_second_exit"):
        assert torch.equal(r0[key], r1[key]), key

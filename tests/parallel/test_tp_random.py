"""Dropout RNG per tensor-parallel rank (issue 25 item 3; see [Note: dropout
in tensor-parallel regions] in dsrun/runtime/parallel/tensor/random.py), on
2 gloo ranks on the CPU: after `model_parallel_cuda_manual_seed`, draws
between a column and a row layer differ across the model ranks, draws
after the row layer are the same on both and are what the default
generator gives had the split region drawn nothing; without the seed
every draw is the same on both ranks; activation checkpointing recomputes
the split region's dropout masks exactly (gradients equal the plain run's).
"""
from __future__ import annotations

import torch

from tests.dist_helpers import run_ranks


def _layers():
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    from dsrun.runtime.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    set_current(ParallelMesh.build(torch.distributed.get_world_size(), model=2))
    return ColumnParallelLinear(8, 16), RowParallelLinear(16, 8)


def _draws(seeded: bool):
    import dsrun
    get_cuda_rng_tracker = dsrun.checkpointing.get_cuda_rng_tracker
    model_parallel_cuda_manual_seed = dsrun.checkpointing.model_parallel_cuda_manual_seed
    dsrun.init_distributed()
    torch.manual_seed(0)
    col, row = _layers()
    x = torch.randn(4, 8)
    get_cuda_rng_tracker().reset()
    if seeded:
        model_parallel_cuda_manual_seed(123)  # also seeds the default generator with 123
    expected = torch.get_rng_state()
    h = col(x)
    split = torch.rand(16)
    row(h)
    replicated = torch.rand(16)
    torch.set_rng_state(expected)
    return split, replicated, torch.rand(16)


def test_split_region_draws_per_rank():
    (s0, r0, want0), (s1, r1, want1) = run_ranks(_draws, 2, True, timeout=120)
    assert not torch.equal(s0, s1)
    assert torch.equal(r0, r1) and torch.equal(r0, want0) and torch.equal(want0, want1)


def test_without_the_seed_every_rank_draws_alike():
    (s0, r0, _), (s1, r1, _) = run_ranks(_draws, 2, False, timeout=120)
    assert torch.equal(s0, s1) and torch.equal(r0, r1)


def _grads(checkpointed: bool):
    import torch.nn.functional as F

    import dsrun
    checkpoint, get_cuda_rng_tracker = dsrun.checkpointing.checkpoint, dsrun.checkpointing.get_cuda_rng_tracker
    model_parallel_cuda_manual_seed = dsrun.checkpointing.model_parallel_cuda_manual_seed
    dsrun.init_distributed()
    torch.manual_seed(0)
    col, row = _layers()
    x = torch.randn(4, 8, requires_grad=True)
    get_cuda_rng_tracker().reset()
    model_parallel_cuda_manual_seed(5)

    def block(t):
        return F.dropout(row(F.dropout(col(t), 0.5)), 0.5)
    out = checkpoint(block, x) if checkpointed else block(x)
    out.sum().backward()
    return out.detach(), x.grad, col.weight.grad


def _both():
    return _grads(False), _grads(True)


def test_activation_checkpointing_replays_split_region_masks():
    for plain, recomputed in run_ranks(_both, 2, timeout=120):
        for a, b in zip(plain, recomputed):
            assert torch.equal(a, b)

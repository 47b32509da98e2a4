"""Ranks that disagree fail loudly on every rank (issue 11, item 1).

Shared-memory collectives check every call's operation, dtype, element count,
root and sequence number at their first barrier; `initialize` compares the
models and resolved configs of all ranks before its first collective.
"""
from __future__ import annotations

import pytest
import torch

from dsrun.ops import shm_comm
from tests.dist_helpers import run_ranks

needs_shm = pytest.mark.skipif(not shm_comm.available(), reason="shm_comm op not built")


def _mismatch(kind: str):
    """Run one disagreeing collective on the shm world group; return what each rank got."""
    import dsrun
    from dsrun.runtime import comm
    from dsrun.runtime.comm.collectives import uses_shm

    dsrun.init_distributed()
    assert uses_shm()
    rank = comm.get_rank()
    try:
        if kind == "count":  # the probe: 4 elements against 6
            comm.all_reduce(torch.ones(4 if rank == 0 else 6))
        elif kind == "dtype":
            comm.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.bfloat16))
        elif kind == "root":
            comm.broadcast(torch.ones(4), src=rank)
        elif kind == "broadcast_count":
            comm.broadcast(torch.ones(4 if rank == 0 else 6), src=0)
        elif kind == "sequence":  # rank 1 skips one call: its next one is a different call
            if rank == 0:
                comm.all_reduce(torch.ones(4))
            comm.broadcast(torch.ones(4), src=0)
        elif kind == "empty":  # an empty all_gather on one rank only
            out = torch.empty(2 * (0 if rank == 0 else 3))
            comm.all_gather_into_tensor(out, torch.ones(0 if rank == 0 else 3))
        else:
            raise AssertionError(kind)
    except shm_comm.ShmCollectiveError as exc:
        return str(exc)
    return None


@needs_shm
@pytest.mark.parametrize("kind, rank0_call, rank1_call", [
    ("count", "all_reduce(4 float32 elements, op sum) (call #", "all_reduce(6 float32 elements, op sum)"),
    ("dtype", "all_reduce(4 float32 elements", "all_reduce(4 bfloat16 elements"),
    ("root", "broadcast(4 float32 elements, root 0)", "broadcast(4 float32 elements, root 1)"),
    ("broadcast_count", "broadcast(4 float32", "broadcast(6 float32"),
    ("sequence", "all_reduce(4 float32 elements, op sum) (call #", "broadcast(4 float32 elements, root 0)"),
    ("empty", "all_gather(0 float32 elements per rank)", "all_gather(3 float32 elements per rank)"),
])
def test_shm_collective_mismatch_fails_on_every_rank_naming_both_calls(kind, rank0_call, rank1_call):
    errors = run_ranks(_mismatch, 2, kind, timeout=120)
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} got no error for a {kind} mismatch"
        assert "ranks disagree: rank 0 called" in error and rank0_call in error, error
        assert f"rank 1 called {rank1_call}" in error, error
    assert errors[0].split(": ", 1)[1] == errors[1].split(": ", 1)[1]  # the same message on both


def _train_model(out_features_by_rank, stage: int, config_by_rank=None):
    import dsrun
    from dsrun.runtime import comm
    from dsrun.runtime.agreement import RankMismatchError
    from dsrun.runtime.config import ConfigError

    rank = int(__import__("os").environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, out_features_by_rank[rank])
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if config_by_rank is not None:
        cfg.update(config_by_rank[rank])
    try:
        engine, *_ = dsrun.initialize(model=model, config=cfg)
    except (RankMismatchError, ConfigError) as exc:
        return type(exc).__name__, str(exc), getattr(exc, "shown_by_rank", None)
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    return "trained", comm.get_rank(), None


@pytest.mark.parametrize("stage", [0, 3])
def test_initialize_rejects_ranks_with_different_models(stage):
    results = run_ranks(_train_model, 2, [2, 3], stage, timeout=120)
    for kind, message, _ in results:
        assert kind == "RankMismatchError", message
        assert "model (parameter names, shapes, dtypes, requires_grad) differs between ranks" in message
        assert "rank 0 has 'weight shape=(2, 4) dtype=float32 requires_grad=True'" in message
        assert "rank 1 has 'weight shape=(3, 4) dtype=float32 requires_grad=True'" in message


def test_initialize_rejects_ranks_with_different_configs():
    per_rank = [{"zero_optimization": {"stage": 1}}, {"zero_optimization": {"stage": 2}}]
    results = run_ranks(_train_model, 2, [2, 2], 0, per_rank, timeout=120)
    for rank, (kind, message, shown_by) in enumerate(results):
        assert kind == "ConfigError", message
        assert ("resolved config differs between ranks: rank 0 has 'zero_optimization.stage = 1', "
                "rank 1 has 'zero_optimization.stage = 2'") in message
        assert shown_by == (None if rank == 0 else 0)  # printed once, by rank 0


def test_initialize_invalid_config_on_one_rank_fails_every_rank():
    per_rank = [{}, {"zero_optimization": {"stage": 7}}]
    results = run_ranks(_train_model, 2, [2, 2], 0, per_rank, timeout=120)
    assert results[0][0] == "ConfigError" and "invalid on rank(s) [1]" in results[0][1]
    assert results[1][0] == "ConfigError" and "zero_optimization.stage" in results[1][1]
    assert results[1][2] is None  # its own message, printed by itself

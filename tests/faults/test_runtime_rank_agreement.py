"""Ranks that disagree fail loudly on every rank (issue 11, item 1).

Shared-memory collectives check every call's operation, dtype, element count,
root and sequence number at their first barrier; `initialize` compares the
models and resolved configs of all ranks before its first collective.
"""
from __future__ import annotations

import os

import pytest
import torch

from dsrun.ops import shm_comm
from tests.dist_helpers import run_ranks

needs_shm = pytest.mark.skipif(not shm_comm.available(), reason="shm_comm op not built")


_KINDS = {  # kind: (rank 0's call, rank 1's call) as the error names them
    "count": ("all_reduce(4 float32 elements, op sum) (call #", "all_reduce(6 float32 elements, op sum)"),
    "dtype": ("all_reduce(4 float32 elements", "all_reduce(4 bfloat16 elements"),
    "op": ("all_reduce(4 float32 elements, op sum)", "all_reduce(4 float32 elements, op max)"),
    "root": ("broadcast(4 float32 elements, root 0)", "broadcast(4 float32 elements, root 1)"),
    "broadcast_count": ("broadcast(4 float32", "broadcast(6 float32"),
    "sequence": ("all_reduce(4 float32 elements, op sum) (call #2)", "broadcast(4 float32 elements, root 0) "
                                                                     "(call #2)"),
    "empty": ("all_gather(0 float32 elements per rank)", "all_gather(3 float32 elements per rank)"),
    "reduce_scatter": ("reduce_scatter(2 float32", "reduce_scatter(3 float32"),
}


def _mismatches():
    """Each kind of disagreement on its own ShmGroup (a failed call closes its
    group); the first through the runtime's comm layer. Returns
    {kind: error message or None} of this rank."""
    import torch.distributed as dist

    import dsrun
    from dsrun.runtime import comm
    from dsrun.runtime.comm.collectives import uses_shm

    dsrun.init_distributed()
    assert uses_shm()
    rank = comm.get_rank()
    out = {}
    try:
        comm.all_reduce(torch.ones(4 if rank == 0 else 6))
    except shm_comm.ShmCollectiveError as exc:
        out["count"] = str(exc)
    for kind in list(_KINDS)[1:]:
        group = shm_comm.ShmGroup(shm_comm.segment_name(os.environ["MASTER_PORT"], kind), rank, 2,
                                  barrier=dist.barrier)
        group.barrier()  # call #1
        try:
            if kind == "dtype":
                group.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.bfloat16))
            elif kind == "op":
                group.all_reduce(torch.ones(4), "sum" if rank == 0 else "max")
            elif kind == "root":
                group.broadcast(torch.ones(4), src=rank)
            elif kind == "broadcast_count":
                group.broadcast(torch.ones(4 if rank == 0 else 6), src=0)
            elif kind == "sequence":  # rank 1 skips a call: its next one is another call
                if rank == 0:
                    group.all_reduce(torch.ones(4))
                group.broadcast(torch.ones(4), src=0)
            elif kind == "empty":  # an empty all_gather on one rank only
                n = 0 if rank == 0 else 3
                group.all_gather(torch.empty(2 * n), torch.ones(n))
            elif kind == "reduce_scatter":
                n = 2 if rank == 0 else 3
                group.reduce_scatter(torch.empty(n), torch.ones(2 * n))
        except shm_comm.ShmCollectiveError as exc:
            out[kind] = str(exc)
        try:
            group.barrier()
        except shm_comm.ShmCollectiveError as exc:
            out[kind + " after"] = str(exc)
    return out


@needs_shm
def test_shm_collective_mismatch_fails_on_every_rank_naming_both_calls():
    results = run_ranks(_mismatches, 2, timeout=180)
    for kind, (rank0_call, rank1_call) in _KINDS.items():
        errors = [r.get(kind) for r in results]
        for rank, error in enumerate(errors):
            assert error is not None, f"rank {rank} got no error for a {kind} mismatch"
            assert error.startswith(f"rank {rank}: ranks disagree: rank 0 called "), error
            assert rank0_call in error and f"rank 1 called {rank1_call}" in error, error
        assert errors[0].split(": ", 1)[1] == errors[1].split(": ", 1)[1]  # the same message on both
        if kind != "count":  # the group that failed refuses further calls
            assert all("the group is closed" in r[kind + " after"] for r in results)


def _initialize(out_features_by_rank, stage: int, config_by_rank=None):
    import dsrun
    from dsrun.runtime.distributed.agreement import RankMismatchError
    from dsrun.runtime.config import ConfigError

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, out_features_by_rank[rank])
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if config_by_rank is not None:
        cfg.update(config_by_rank[rank])
    try:
        engine, *_ = dsrun.initialize(model=model, config=cfg)
    except (RankMismatchError, ConfigError) as exc:
        return type(exc).__name__, str(exc), getattr(exc, "shown_by_rank", None), getattr(exc, "quiet_ranks", 0)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    return "trained", None, None, 0


def _scenarios():
    """Every scenario in one job, one after the other (each fails on every rank alike)."""
    return {
        "models stage 0": _initialize([2, 3], 0),
        "models stage 3": _initialize([2, 3], 3),
        "configs": _initialize([2, 2], 0, [{"zero_optimization": {"stage": 1}},
                                           {"zero_optimization": {"stage": 2}}]),
        "invalid on rank 1": _initialize([2, 2], 0, [{}, {"zero_optimization": {"stage": 7}}]),
        "same": _initialize([2, 2], 1),
    }


def test_initialize_checks_that_ranks_agree():
    results = run_ranks(_scenarios, 2, timeout=180)
    for rank, result in enumerate(results):
        for stage in (0, 3):  # different models (the Linear(4, 2) against Linear(4, 3))
            kind, message, _, _ = result[f"models stage {stage}"]
            assert kind == "RankMismatchError", message
            assert message.startswith(f"rank {rank}: the model (parameter names, shapes, dtypes, "
                                      "requires_grad) differs between ranks")
            assert "rank 0 has 'weight shape=(2, 4) dtype=float32 requires_grad=True'" in message
            assert "rank 1 has 'weight shape=(3, 4) dtype=float32 requires_grad=True'" in message
        kind, message, shown_by, quiet = result["configs"]  # different ZeRO stages
        assert kind == "ConfigError", message
        assert ("resolved config differs between ranks: rank 0 has 'zero_optimization.stage = 1', "
                "rank 1 has 'zero_optimization.stage = 2'") in message
        assert (shown_by, quiet) == ((None, 1) if rank == 0 else (0, 0))  # printed once, by rank 0
        assert result["same"][0] == "trained"
    invalid = [r["invalid on rank 1"] for r in results]
    assert invalid[0][0] == "ConfigError" and "invalid on rank(s) [1]" in invalid[0][1]
    assert invalid[1][0] == "ConfigError" and "zero_optimization.stage" in invalid[1][1]
    assert invalid[1][2] is None  # its own message, printed by itself

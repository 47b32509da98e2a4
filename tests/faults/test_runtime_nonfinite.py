"""A non-finite gradient is never applied (issue 11, item 3).

Every precision and stage skips the update on every rank, warns naming the
parameter and the step, counts it in `skipped_steps`, and stops with
NonFiniteStepsError after `max_consecutive_nonfinite_steps` in a row.
"""
from __future__ import annotations

import logging

import torch

from tests.dist_helpers import run_ranks


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _poisoned_steps(stage: int, precision: str, steps: int, limit: int | None):
    """Train a Linear on 2 ranks; rank 1's gradient of `1.weight` is nan at every step."""
    import dsrun
    from dsrun.runtime.engine.engine import NonFiniteStepsError

    records = _Records()
    logging.getLogger("dsrun").addHandler(records)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if limit is not None:
        cfg["max_consecutive_nonfinite_steps"] = limit
    engine, _, _, sched = dsrun.initialize(model=model, config=cfg)
    if engine.global_rank == 1:
        model[1].weight.register_hook(lambda g: g * float("nan"))
    before = [p.detach().float().clone() for p in model.parameters()]
    error = None
    try:
        for _ in range(steps):
            x = torch.ones(2, 4, dtype=next(model.parameters()).dtype)
            engine.backward(engine(x).float().sum())
            engine.step()
    except NonFiniteStepsError as exc:
        error = str(exc)
    logging.getLogger("dsrun").removeHandler(records)
    after = [p.detach().float().clone() for p in model.parameters()] if stage < 3 else None
    return {"applied": engine.was_step_applied(), "skipped": engine.skipped_steps,
            "global_steps": engine.global_steps, "sched": sched.last_batch_iteration,
            "unchanged": after is None or all(torch.equal(a, b) for a, b in zip(before, after)),
            "finite": all(bool(torch.isfinite(p.detach().float()).all()) for p in model.parameters()
                          if p.numel()),
            "warnings": records.messages, "error": error}


def _all_cases():
    """The cases below, one after the other in one job."""
    return {"skip stage 0 fp32": _poisoned_steps(0, "fp32", 2, None),
            "skip stage 3 bf16": _poisoned_steps(3, "bf16", 2, None),
            "stop stage 0": _poisoned_steps(0, "fp32", 5, 3)}


def test_nonfinite_steps_are_skipped_then_stop_every_rank():
    results = run_ranks(_all_cases, 2, timeout=180)
    for case in ("skip stage 0 fp32", "skip stage 3 bf16"):
        for rank, r in enumerate(result[case] for result in results):
            assert not r["applied"] and r["skipped"] == 2 and r["global_steps"] == 2, (case, r)
            assert r["sched"] == -1, "the LR schedule moved on a skipped step"
            assert r["unchanged"] and r["finite"], "a non-finite update was applied"
            assert r["error"] is None
        warnings = [m for m in results[0][case]["warnings"] if "non-finite" in m]
        assert "step 1: non-finite (inf/nan) gradient (first in parameter 1.weight)" in warnings[0], warnings
        assert "2 in a row; the run stops at 10" in warnings[-1]
    for rank, result in enumerate(results):  # max_consecutive_nonfinite_steps: 3
        r = result["stop stage 0"]
        assert r["error"] is not None, f"rank {rank} did not stop"
        assert f"rank {rank}: 3 optimizer steps in a row (steps 1-3) had non-finite" in r["error"]
        assert "first in parameter 1.weight" in r["error"] and "max_consecutive_nonfinite_steps" in r["error"]
        assert r["global_steps"] == 3 and r["finite"]

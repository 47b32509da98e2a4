"""Stage-0 data parallelism trains to the same parameters as one process.

[Note: tolerance of the equivalence tests]
Each rank averages the loss over its micro-batch; the engine divides by the
gradient accumulation steps G, autograd sums the G micro-steps and the
all-reduce sums the ranks before dividing by the world size. Mathematically
that is the mean over the global batch, which the single-process reference
computes in one go; but the floating-point summation order differs, so the
gradients agree to about 1e-7 relative, not bit for bit. Adam divides by
sqrt(v), which can amplify such differences a little in the first steps, so
parameters are compared with rtol=1e-5, atol=1e-6 after 4 steps -- far
below the ~1e-2 per-step change an actual bug (a missing average, a lost
micro-step, a wrong clip or lr) produces.
"""
from __future__ import annotations

import math

import pytest
import torch

import dsrun
from tests.dist_helpers import run_ranks

GLOBAL_BATCH = 8
STEPS = 4
FEATURES, HIDDEN, OUT = 6, 16, 3
CLIP = 0.5
LR_MIN, LR_MAX, WARMUP = 1e-3, 1e-2, 3


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS, GLOBAL_BATCH, FEATURES, generator=g)
    y = torch.randn(STEPS, GLOBAL_BATCH, OUT, generator=g)
    return x, y


def _config(micro: int, gas: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR_MAX, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": LR_MIN, "warmup_max_lr": LR_MAX, "warmup_num_steps": WARMUP,
            "warmup_type": "linear"}},
        # 60 elements: forces several buckets (the model has 467 parameters).
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 60},
    }


def _expected_lr(step: int) -> float:
    """WarmupLR (linear) for optimizer step `step` (0-based), computed from its formula.

    Construction writes lr(t=-1) = min; after step s the schedule is at t=s.
    """
    t = step - 1
    if t < 0:
        return LR_MIN
    gamma = t / WARMUP if t < WARMUP else 1.0
    return LR_MIN + (LR_MAX - LR_MIN) * gamma


def _reference() -> list[torch.Tensor]:
    """Plain PyTorch, one process, the whole global batch per step."""
    model = _model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR_MAX, weight_decay=0.01, fused=True)
    x, y = _data()
    for s in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = _expected_lr(s)
        loss = torch.nn.functional.mse_loss(model(x[s]), y[s])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _grad_bytes(engine) -> int:
    stats = engine.comm_stats().get("all_reduce")
    return stats.bytes if stats else 0


def _train_rank(gas: int) -> dict:
    """One rank: train STEPS steps through dsrun; record all-reduce bytes per micro-step."""
    topo = dsrun.init_distributed()
    ws = topo.world_size
    micro = GLOBAL_BATCH // (ws * gas)
    # A different seed per rank: initialize() must broadcast rank 0's weights.
    model = _model(seed=topo.rank)
    engine, _, _, sched = dsrun.initialize(model=model, config=_config(micro, gas))
    x, y = _data()
    bytes_per_micro, lrs = [], []
    for s in range(STEPS):
        lrs.append(engine.get_lr()[0])
        for k in range(gas):
            # Rank r, micro-step k takes its slice of the global batch.
            lo = (topo.rank * gas + k) * micro
            before = _grad_bytes(engine)
            loss = torch.nn.functional.mse_loss(engine(x[s, lo:lo + micro]), y[s, lo:lo + micro])
            engine.backward(loss)
            bytes_per_micro.append(_grad_bytes(engine) - before)
            engine.step()
    assert engine.global_steps == STEPS and engine.global_samples == STEPS * GLOBAL_BATCH
    return {"params": [p.detach().clone() for p in engine.module.parameters()],
            "bytes": bytes_per_micro, "lrs": lrs,
            "numel": sum(p.numel() for p in model.parameters()),
            "norm": engine.get_global_grad_norm()}


@pytest.mark.parametrize("world_size,gas", [(1, 1), (4, 1), (2, 4)])
def test_matches_single_process(world_size: int, gas: int) -> None:
    """1, 2 and 4 ranks (2 ranks with G=4 accumulation steps, equal to the large-batch step) x G micro-steps reach the single-process parameters (see [Note: tolerance...]).

    Also: every rank ends identical; the LR follows WarmupLR; accumulation
    micro-steps send no gradient bytes and the boundary sends exactly
    4 bytes per parameter (fp32); one rank alone sends none (its buckets
    have no one to sum with).
    """
    results = run_ranks(_train_rank, world_size, gas, timeout=180)
    expected = _reference()
    for r in results:
        for got, want in zip(r["params"], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(r["params"], results[0]["params"]):
            assert torch.equal(got, want), "ranks diverged"
        assert r["lrs"] == pytest.approx([_expected_lr(s) for s in range(STEPS)])
        boundary = [(k + 1) % gas == 0 for k in range(STEPS * gas)]
        assert r["bytes"] == [r["numel"] * 4 if b and world_size > 1 else 0 for b in boundary]
        assert r["norm"] is not None and math.isfinite(r["norm"])


def _no_sync_rank() -> list:
    topo = dsrun.init_distributed()
    engine, *_ = dsrun.initialize(model=_model(0), config=_config(4, 1))
    x, y = _data()
    n = sum(p.numel() for p in engine.module.parameters())
    sent = []
    before = _grad_bytes(engine)
    with engine.no_sync():
        engine.backward(torch.nn.functional.mse_loss(engine(x[0, :4]), y[0, :4]))
        sent.append(_grad_bytes(engine) - before)
        try:
            engine.step()
        except RuntimeError as exc:
            sent.append(str(exc))
    before = _grad_bytes(engine)
    engine.backward(torch.nn.functional.mse_loss(engine(x[0, 4:]), y[0, 4:]))
    sent.append(_grad_bytes(engine) - before)
    engine.step()
    sent.append(n * 4)
    return sent


def test_no_sync_sends_nothing() -> None:
    """Backward inside no_sync() sends 0 bytes; step() there is refused; the next sync sends all."""
    for got in run_ranks(_no_sync_rank, 2, timeout=120):
        assert got[0] == 0
        assert "no_sync" in got[1]
        assert got[2] == got[3]

"""Checkpoints reshard across tensor-parallel sizes (issue 25 item 4; see
[Note: tensor-parallel checkpoints] in dsrun/runtime/checkpoint/tensor_split.py).

A tiny Hugging Face GPT-2 (fused q/k/v in a transposed Conv1D) and a tiny
Llama (2 key/value heads: replicated at tp=4) are sharded by AutoTP,
trained 2 AdamW steps at tp=2 (x dp=1, ZeRO off; x dp=2, ZeRO-1), saved,
and loaded at tp=1 (the plain model, one rank) and tp=4 (4 ranks). Every
rank's parameter slice and Adam moments after the load equal, bit for bit,
the elements of the full tensors put together from the tp=2 ranks' slices
at save time; the next step's loss equals the uninterrupted tp=2 run's
(rtol = atol = 1e-5: the layouts sum their matmuls in other orders);
`dsrun-ckpt export` of the tp=2 checkpoint gives the plain model's state
dict after the load, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_autotp import _build, _ids, _lm_loss

TOL = {"rtol": 1e-5, "atol": 1e-5}
STEPS = 2
BATCH = 8


def _config(stage: int, micro: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000}


def _engine(kind: str, tp: int, stage: int):
    import torch.distributed as dist

    import dsrun
    dsrun.init_distributed()
    model = _build(kind)
    if tp > 1:
        model = dsrun.tp_model_init(model, tp, torch.float32)
    dp = dist.get_world_size() // tp
    engine, *_ = dsrun.initialize(model=model, config=_config(stage, BATCH // dp))
    return engine, dist.get_rank() // tp, BATCH // dp


def _step(kind: str, engine, data_rank: int, micro: int, step: int) -> float:
    """One step on the global batch of `step`; the mean loss over all samples."""
    import torch.distributed as dist
    batch = _ids(100 + step, batch=BATCH)[data_rank * micro:(data_rank + 1) * micro]
    loss = _lm_loss(kind, engine, batch)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # tensor-parallel ranks hold the same loss
    return float(mean) / dist.get_world_size()


def _slices(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Parameter name -> (positions of this rank's elements in the full
    flattened tensor, values, exp_avg, exp_avg_sq), fp32 masters (collective
    under ZeRO)."""
    from dsrun.runtime.parallel.tensor.split import split_of
    strategy, out = engine.strategy, {}
    for name, p in engine.module.named_parameters():
        if strategy.manages(p):
            value = strategy.full_fp32_param(p)
            states = [strategy.full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
        else:
            value = p.detach()
            states = [engine.optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq")]
        split = split_of(p)
        positions = split.local_index().view(-1) if split is not None else torch.arange(p.numel())
        out[name] = (positions, value.detach().reshape(-1).cpu().clone(),
                     *(s.reshape(-1).cpu().clone() for s in states))
    return out


def _save(kind: str, tp: int, stage: int, path: str):
    """Train STEPS steps at tp, save, take one more step. Returns (slices at
    save time, the next step's loss)."""
    engine, data_rank, micro = _engine(kind, tp, stage)
    for step in range(STEPS):
        _step(kind, engine, data_rank, micro, step)
    engine.save_checkpoint(path, tag="t")
    held = _slices(engine)
    return held, _step(kind, engine, data_rank, micro, STEPS)


def _load(kind: str, tp: int, stage: int, path: str, export_dir: str | None):
    """Load at tp, take the next step. Returns (slices after the load, the
    step's loss, the module's state dict (rank 0, when export_dir: the
    export of the checkpoint beside it))."""
    engine, data_rank, micro = _engine(kind, tp, stage)
    engine.load_checkpoint(path, tag="t")
    held = _slices(engine)
    state, exported = None, None
    if export_dir is not None:
        import os

        from safetensors.torch import load_file

        from dsrun.runtime.checkpoint.cli import export_hf
        export_hf(os.path.join(path, "t"), export_dir, torch.float32, 1 << 40)
        exported = load_file(os.path.join(export_dir, "model.safetensors"))
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return held, _step(kind, engine, data_rank, micro, STEPS), state, exported


def _full(per_rank: list[dict]) -> dict[str, list[torch.Tensor]]:
    """The full flattened tensors (value, exp_avg, exp_avg_sq) put together
    from every rank's slices; each element must be held alike by all the
    ranks holding it."""
    out = {}
    for name in per_rank[0]:
        numel = max(int(r[name][0].max()) for r in per_rank) + 1
        full = [torch.full((numel,), float("nan")) for _ in range(3)]
        for r in per_rank:
            positions, *values = r[name]
            for f, v in zip(full, values):
                f[positions] = v
        for r in per_rank:  # replicas (data ranks, replicated key/value heads) agree
            positions, *values = r[name]
            for f, v in zip(full, values):
                assert torch.equal(f[positions], v), name
        assert not any(f.isnan().any() for f in full), name
        out[name] = full
    return out


def _check_slices(full: dict, per_rank: list[dict]) -> None:
    for r in per_rank:
        assert set(r) == set(full)
        for name, (positions, *values) in r.items():
            for what, f, v in zip(("value", "exp_avg", "exp_avg_sq"), full[name], values):
                assert torch.equal(f[positions], v), f"{name} {what} differs after the load"


@pytest.mark.parametrize("kind,save_world,stage", [("gpt2", 2, 0), ("llama", 2, 0), ("gpt2", 4, 1),
                                                     ("llama", 4, 1)])
def test_tp2_checkpoint_loads_at_tp1_and_tp4(kind, save_world, stage, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, save_world, kind, 2, stage, path, timeout=240)
    full = _full([held for held, _ in saved])
    next_loss = saved[0][1]

    plain = run_ranks(_load, 1, kind, 1, stage, path, str(tmp_path / "export"), timeout=240)
    _check_slices(full, [plain[0][0]])
    torch.testing.assert_close(plain[0][1], next_loss, **TOL)
    state, exported = plain[0][2], plain[0][3]
    assert set(exported) <= set(state) and set(state) - set(exported) <= {"lm_head.weight"}  # GPT-2 ties it
    for name, value in exported.items():
        assert torch.equal(value, state[name]), name

    tp4 = run_ranks(_load, 4, kind, 4, stage, path, None, timeout=240)
    _check_slices(full, [held for held, *_ in tp4])
    torch.testing.assert_close(tp4[0][1], next_loss, **TOL)

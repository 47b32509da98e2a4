"""Runtime misuse gets a clear error (issue 11, item 16)."""
from __future__ import annotations

import pytest
import torch

import dsrun
from tests.dist_helpers import run_ranks

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_model_without_trainable_parameters_is_rejected():
    model = torch.nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"no trainable parameters \(2 parameters, none with requires_grad"):
        dsrun.initialize(model=model, config=BASE)


def test_parameters_on_the_meta_device_are_rejected():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"4 parameters/buffers of the model are on the meta device .* "
                                         r"first '0.weight'; materialize them .*zero.Init"):
        dsrun.initialize(model=model, config=BASE)


class _TupleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        out = self.lin(x)
        return out.sum(), {"loss": out.sum(), "logits": out}


def _misuse():
    from dsrun.runtime.lr_schedules import build_lr_scheduler  # noqa: F401 - imported like a user would

    cfg = dict(BASE, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                                "warmup_max_lr": 0.1}})
    engine, _, _, sched = dsrun.initialize(model=_TupleModel(), config=cfg)
    out = {}
    outputs = engine(torch.ones(2, 3))
    for name, value in (("tuple", outputs), ("dict", outputs[1]), ("vector", outputs[1]["logits"])):
        try:
            engine.backward(value)
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    weight = engine.module.lin.weight.detach().clone()
    try:
        engine.step()
    except RuntimeError as exc:
        out["step"] = str(exc)
    out["after_bad_step"] = [engine.global_steps, engine.micro_steps, sched.last_batch_iteration,
                             torch.equal(weight, engine.module.lin.weight)]
    engine.backward(outputs[0])
    engine.step()
    out["after_good_step"] = [engine.global_steps, sched.last_batch_iteration, engine.was_step_applied()]
    try:
        engine.step()
    except RuntimeError as exc:
        out["second_step"] = str(exc)
    return out


class _Bare(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(3))


def _meta_under_zero_init():
    """zero.Init materializes meta parameters with reset_parameters(): the
    values a CPU build with the same seed gets; a module without one is an error."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    torch.manual_seed(0)
    with dsrun.zero.Init():
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    same = all(torch.equal(p.ds_tensor[:r.numel()], r.detach().reshape(-1))
               for p, r in zip(model.parameters(), reference.parameters()))
    engine, *_ = dsrun.initialize(model=model, config=dict(BASE, zero_optimization={"stage": 3}))
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    try:
        with dsrun.zero.Init():
            with torch.device("meta"):
                _Bare()
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"same_as_cpu_build": same, "trained": engine.was_step_applied(), "bare": error}


def _misuse_cases():
    return {**_misuse(), "meta": _meta_under_zero_init()}


def test_engine_misuse_errors_and_meta_parameters_under_zero_init():
    out, = run_ranks(_misuse_cases, 1, timeout=120)
    assert out["tuple"].startswith("TypeError: engine.backward() needs the scalar loss tensor, got a tuple "
                                   "of 2 elements"), out
    assert "engine.backward(outputs[0])" in out["tuple"]
    assert out["dict"].startswith("TypeError: engine.backward() needs the scalar loss tensor, got a dict "
                                  "with keys ['logits', 'loss']"), out
    assert out["vector"].startswith("ValueError: engine.backward() needs a scalar loss, got a tensor of "
                                    "shape (2, 1)"), out
    assert out["step"].startswith("engine.step() without engine.backward() since the previous step()"), out
    assert out["after_bad_step"] == [0, 0, -1, True], "a step without backward counted or moved the LR"
    assert out["after_good_step"] == [1, 0, True]
    assert "without engine.backward()" in out["second_step"]
    assert out["meta"]["same_as_cpu_build"] and out["meta"]["trained"], out["meta"]
    assert out["meta"]["bare"].startswith("zero.Init: _Bare created parameters ['w'] on the meta device and "
                                          "has no reset_parameters()"), out["meta"]

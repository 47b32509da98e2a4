"""Each LR schedule follows DeepSpeed's documented formula.

Expected values are written out here from the formulas (DeepSpeed docs,
"Learning Rate Schedulers"), not computed with dsrun's helpers. `lr_at(t)`
is the lr the optimizer holds after the schedule reached
last_batch_iteration = t (t = -1: right after construction).
"""
from __future__ import annotations

import math

import pytest
import torch

from dsrun.runtime.config import ConfigError
from dsrun.runtime.optim.lr_schedules import build_lr_scheduler


def _optimizer(kind=torch.optim.SGD, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return kind(params, lr=0.1)


def _lrs(sched_type: str, params: dict, steps: int, kind=torch.optim.SGD) -> dict[int, float]:
    opt = _optimizer(kind)
    sched = build_lr_scheduler(sched_type, params, opt)
    out = {-1: opt.param_groups[0]["lr"]}
    for t in range(steps):
        sched.step()
        out[t] = opt.param_groups[0]["lr"]
        assert sched.get_last_lr() == [out[t]]
    return out


def test_warmup_lr_log() -> None:
    got = _lrs("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1,
                            "warmup_num_steps": 10}, 15)
    assert got[-1] == pytest.approx(0.01)
    for t in (0, 1, 5, 9):
        assert got[t] == pytest.approx(0.01 + 0.09 * math.log(t + 1) / math.log(10))
    assert got[10] == got[14] == pytest.approx(0.1)


def test_warmup_decay_lr_linear() -> None:
    got = _lrs("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 0.0,
                                 "warmup_max_lr": 0.1, "warmup_num_steps": 5,
                                 "warmup_type": "linear"}, 25)
    for t in (0, 2, 4):
        assert got[t] == pytest.approx(0.1 * t / 5)
    for t in (5, 12, 19, 20, 24):
        assert got[t] == pytest.approx(0.1 * max(0.0, (20 - t) / (20 - 5)))


def test_warmup_cosine_lr() -> None:
    got = _lrs("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 10,
                                  "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}, 35)
    assert got[-1] == 0.0  # ratio is 0 before the first step, as in DeepSpeed
    for t in (0, 3, 9):
        assert got[t] == pytest.approx(0.1 * (0.1 + 0.9 * math.log(t + 1) / math.log(10)))
    for t in (10, 20, 29, 34):
        p = min(1.0, (t - 10 + 1) / 20)
        assert got[t] == pytest.approx(0.1 * (0.01 + 0.99 * (1 + math.cos(math.pi * p)) / 2))


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    got = _lrs("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 4,
                               "lr_range_test_step_rate": 2.0,
                               "lr_range_test_staircase": staircase}, 10)
    assert got[-1] == pytest.approx(0.001)
    for t in (0, 3, 6, 9):
        interval = (t + 1) / 4
        if staircase:
            interval = math.floor(interval)
        assert got[t] == pytest.approx(0.001 * (1 + 2.0 * interval))


def test_one_cycle_lr_and_momentum() -> None:
    opt = _optimizer(torch.optim.Adam)
    sched = build_lr_scheduler("OneCycle", {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
        "cycle_second_step_size": 6, "decay_step_size": 2, "decay_lr_rate": 0.5,
        "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.1}, opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert opt.param_groups[0]["betas"] == pytest.approx((0.85, 0.99))
    for t in range(16):
        sched.step()
        lr, beta1 = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]
        n = t + 1
        if t < 10:  # in the cycle: up over 4 steps, down over 6
            x = n / 10 - math.floor(n / 10)
            s = x / 0.4 if x <= 0.4 else (x - 1) / (0.4 - 1)
            assert lr == pytest.approx(0.01 + 0.09 * s), t
            assert beta1 == pytest.approx(0.95 - 0.1 * s), t
        else:  # decay: every decay_step_size steps
            d = (t - 10 + 1) / 2
            assert lr == pytest.approx(0.01 / (1 + 0.5 * d)), t
            assert beta1 == pytest.approx(0.95 * (1 + 0.1 * d)), t
    assert opt.param_groups[0]["betas"][1] == 0.99


def test_state_dict_round_trip() -> None:
    params = {"total_num_steps": 20, "warmup_num_steps": 5}
    a_opt, b_opt = _optimizer(), _optimizer()
    a = build_lr_scheduler("WarmupCosineLR", params, a_opt)
    for _ in range(7):
        a.step()
    b = build_lr_scheduler("WarmupCosineLR", params, b_opt)
    b.load_state_dict(a.state_dict())
    assert b_opt.param_groups[0]["lr"] == a_opt.param_groups[0]["lr"]
    a.step(), b.step()
    assert b.get_last_lr() == a.get_last_lr()


def test_per_group_values_and_errors() -> None:
    opt = _optimizer(groups=2)
    build_lr_scheduler("WarmupLR", {"warmup_min_lr": [0.0, 0.5], "warmup_max_lr": 1.0,
                                    "warmup_num_steps": 4}, opt)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.5]
    with pytest.raises(ConfigError, match="warmup_min_lr.*2 optimizer parameter groups"):
        build_lr_scheduler("WarmupLR", {"warmup_min_lr": [0.0, 0.1, 0.2]}, opt)
    with pytest.raises(ConfigError, match="warmup_steps.*accepted: .*warmup_num_steps"):
        build_lr_scheduler("WarmupLR", {"warmup_steps": 10}, opt)
    with pytest.raises(ConfigError, match="total_num_steps"):
        build_lr_scheduler("WarmupDecayLR", {}, opt)
    with pytest.raises(ConfigError, match="warmup_type"):
        build_lr_scheduler("WarmupLR", {"warmup_type": "cosine"}, opt)

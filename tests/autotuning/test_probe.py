"""The engine's side of a trial (dsrun/runtime/engine/autotuning_probe.py), on two gloo ranks."""
from __future__ import annotations

import os

import torch

import dsrun
from dsrun.autotuning.results import read_result
from dsrun.env import AUTOTUNING_RESULT
from tests.dist_helpers import run_ranks

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3}}


def _steps(engine, steps: int) -> None:
    for _ in range(steps * engine.gradient_accumulation_steps()):
        tokens = torch.randint(0, 10, (4, 6))
        loss = engine(tokens.float()).square().mean()
        engine.backward(loss)
        engine.step()


def _rank_main(path: str) -> dict:
    torch.manual_seed(0)
    plain, *_ = dsrun.initialize(model=torch.nn.Linear(6, 3), config=CONFIG)
    _steps(plain, 5)  # no DSRUN_AUTOTUNING_RESULT: the autotuning section changes nothing
    os.environ[AUTOTUNING_RESULT.name] = path
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(6, 3), config=CONFIG)
    try:
        _steps(engine, 5)
    except SystemExit as stop:
        return {"plain_steps": plain.global_steps, "exit": stop.code, "steps": engine.global_steps}
    return {"plain_steps": plain.global_steps, "exit": None, "steps": engine.global_steps}


def test_trial_writes_its_result_after_the_last_profile_step_and_exits(tmp_path):
    path = tmp_path / "trial" / "result.json"
    out = run_ranks(_rank_main, 2, str(path), timeout=120)
    assert out == [{"plain_steps": 5, "exit": 0, "steps": 3}] * 2
    r = read_result(path)
    assert (r.world_size, r.ranks_per_node, r.device, r.num_params) == (2, 2, "cpu", 6 * 3 + 3)
    assert (r.train_batch_size, r.micro_batch, r.grad_accum) == (16, 4, 2)
    assert len(r.step_seconds) == 2 and min(r.step_seconds) > 0  # steps 2 and 3
    assert r.tokens == 0  # float inputs carry no token ids
    assert len(r.peak_memory) == 2 and all(p >= b > 0 for p, b in zip(r.peak_memory, r.base_memory))
    assert min(r.host_available) > 0 and r.device_total == (0, 0)

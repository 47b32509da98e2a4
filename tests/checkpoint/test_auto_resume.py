"""Config `checkpoint.auto_resume`: initialize() starts fresh on an empty save_dir, resumes the newest
complete checkpoint otherwise (counters, weights), and refuses the key without save_dir."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.runtime.config import ConfigError, load_config
from tests.dist_helpers import run_ranks


def _config(save_dir: str) -> dict:
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1},
            "checkpoint": {"auto_resume": True, "save_dir": save_dir}}


def _train_then_resume(save_dir: str) -> tuple:
    torch.manual_seed(0)
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(3, 1), config=_config(save_dir))
    fresh = (engine.resumed_checkpoint, engine.resumed_client_state, engine.global_steps)
    for step in range(3):
        for _ in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(torch.full((1, 3), float(step))).square().mean())
            engine.step()
        engine.save_checkpoint(save_dir, client_state={"step": engine.global_steps})
    weights = [p.detach().clone() for p in engine.module.parameters()]
    torch.manual_seed(1)  # another initial model: only the checkpoint can make them equal
    again, *_ = dsrun.initialize(model=torch.nn.Linear(3, 1), config=_config(save_dir))
    resumed = (again.resumed_checkpoint, again.resumed_client_state, again.global_steps, again.micro_steps)
    same = all(torch.equal(a, b) for a, b in zip(weights, again.module.parameters()))
    return fresh, resumed, same


def test_fresh_start_then_resume_from_the_newest(tmp_path):
    for fresh, resumed, same in run_ranks(_train_then_resume, 2, str(tmp_path / "ckpt")):
        assert fresh == (None, None, 0)
        assert resumed == (str(tmp_path / "ckpt" / "global_step3"), {"step": 3}, 3, 6)
        assert same


def test_auto_resume_needs_save_dir():
    with pytest.raises(ConfigError, match="checkpoint.save_dir: auto_resume needs save_dir"):
        load_config({"train_batch_size": 2, "checkpoint": {"auto_resume": True}}, world_size=1)

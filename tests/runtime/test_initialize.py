"""dsrun.initialize(): where config, optimizer, scheduler and data come from."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsrun
from dsrun.runtime.config import ConfigError
from tests.dist_helpers import run_ranks

ROOT = Path(__file__).resolve().parents[2]
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "steps_per_print": 1000}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def test_add_config_arguments() -> None:
    parser = dsrun.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "a.json"])
    assert args.deepspeed and args.deepspeed_config == "a.json"
    assert parser.parse_args(["--config", "b.json"]).deepspeed_config == "b.json"
    assert not parser.parse_args([]).deepspeed


@pytest.mark.parametrize("kwargs,match", [
    ({"config": BASE, "config_params": BASE}, "both config= and config_params="),
    ({"config": BASE, "args": argparse.Namespace(deepspeed_config="x.json")},
     "also as args.deepspeed_config"),
    ({"args": argparse.Namespace(deepspeed_config="x.json", config="model.yaml")},
     "x.json"),  # the script's own --config is not the ds_config: deepspeed_config wins
    ({}, "no config"),
])
def test_config_sources_conflicts(kwargs: dict, match: str) -> None:
    """Config errors are raised before any process group is created."""
    with pytest.raises(ConfigError, match=match):
        dsrun.initialize(model=_model(), **kwargs)


def _single_process_main(tmp: str) -> dict:
    """Runs in a fresh interpreter with no rank variables: world size 1."""
    cfg = dict(BASE, optimizer={"type": "SGD", "params": {"lr": 0.1}},
               scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
    path = Path(tmp) / "ds.json"
    path.write_text(json.dumps(cfg))
    out = {}
    # Path via args.deepspeed_config, optimizer + scheduler from the config.
    args = dsrun.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed_config", str(path)])
    engine, opt, loader, sched = dsrun.initialize(args=args, model=_model(),
                                                  training_data=_Squares())
    out["world"] = engine.world_size
    out["types"] = [type(opt).__name__, type(sched).__name__]
    out["batches"] = [b.flatten().tolist() for b in loader]
    loss = engine(torch.ones(2, 3)).sum()
    engine.backward(loss)
    engine.step()
    out["stepped"] = [engine.global_steps, engine.was_step_applied()]
    # Factories + parameter groups, config as a path string.
    path.write_text(json.dumps(BASE))
    model = _model()
    groups = [{"params": model[0].parameters(), "lr": 0.5},
              {"params": model[1].parameters()}]
    engine, opt, loader, sched = dsrun.initialize(
        model=model, model_parameters=groups, config=str(path),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    out["group_lrs"] = engine.get_lr()
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    out["group_lrs_after"] = engine.get_lr()
    out["loader"] = loader
    return out


def test_single_process_without_rank_env(tmp_path: Path) -> None:
    """No RANK/WORLD_SIZE: world size 1; config from args or path; factories; groups; data."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    code = ("import json, sys; from tests.runtime.test_initialize import _single_process_main;"
            f"print(json.dumps(_single_process_main({str(tmp_path)!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["world"] == 1
    assert out["types"] == ["SGD", "WarmupLR"]
    flat = sorted(x for b in out["batches"] for x in b)
    assert flat == [float(i) for i in range(10)]
    assert [len(b) for b in out["batches"]] == [2] * 5
    assert out["stepped"] == [1, True]
    assert out["group_lrs"] == [0.5, 0.01]
    assert out["group_lrs_after"] == [0.25, 0.005]
    assert out["loader"] is None


def _shard_rank() -> list[list[float]]:
    dsrun.init_distributed()
    engine, _, loader, _ = dsrun.initialize(
        model=_model(), training_data=_Squares(),
        config=dict(BASE, optimizer={"type": "AdamW", "params": {}}))
    epochs = []
    for _ in range(2):
        epochs.append([x for batch in loader for x in batch.flatten().tolist()])
        assert all(len(b) <= 2 for b in loader)
    return epochs


def test_dataloader_shards_per_rank() -> None:
    """Each rank reads a disjoint half of the dataset in micro-batches; epochs reshuffle."""
    r0, r1 = run_ranks(_shard_rank, 2, timeout=120)
    for epoch in (0, 1):
        assert len(r0[epoch]) == len(r1[epoch]) == 5
        assert sorted(r0[epoch] + r1[epoch]) == [float(i) for i in range(10)]
    assert r0[0] != r0[1] or r1[0] != r1[1]

"""dump_state: rank 0 prints the engine's resolved configuration and state
when initialize returns (DeepSpeed prints its configuration and, with
dump_state, the engine's attributes); the other ranks print nothing."""
from __future__ import annotations

import re

import torch

import dsrun
from tests.dist_helpers import run_ranks

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "steps_per_print": 10**6,
          "zero_optimization": {"stage": 1, "reduce_bucket_size": 1234},
          "bf16": {"enabled": True}, "gradient_predivide_factor": 2.0}


def _field(text: str, section: str, name: str) -> str:
    """The value on the `name ..... value` line of the dump's `section`
    ("configuration" or "state")."""
    config, _, state = text.partition("Engine state:")
    part = state if section == "state" else config
    (value,) = re.findall(rf"^  {re.escape(name)} \.+ (.*)$", part, flags=re.MULTILINE)
    return value


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))


def test_dump_state_prints_configuration_and_state(capsys):
    model = _model()
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                                  config={**CONFIG, "dump_state": True})
    out = capsys.readouterr().out
    engine.destroy()
    assert engine.dump_state()
    assert "Engine configuration:" in out and "Engine state:" in out
    # configuration: every resolved key, defaults included
    assert _field(out, "configuration", "zero_optimization.reduce_bucket_size") == "1234"
    assert _field(out, "configuration", "gradient_accumulation_steps") == "3"
    assert _field(out, "configuration", "fp16.enabled") == "False"
    assert _field(out, "configuration", "dump_state") == "True"
    # state: what the engine made of it
    assert _field(out, "state", "strategy") == "PartitionedOptimizerStrategy"
    assert _field(out, "state", "zero_stage") == "1"
    assert _field(out, "state", "compute_dtype") == "bfloat16"
    assert _field(out, "state", "train_batch_size") == "6"
    assert _field(out, "state", "parameters") == str(3 * 4 + 4 + 4 + 1)
    assert _field(out, "state", "gradient_divided_before_reduction_by") == "2.0"
    assert _field(out, "state", "gradient_divided_after_reduction_by") == "0.5"
    assert _field(out, "state", "optimizer") == "AdamW"
    assert _field(out, "state", "optimizer.param_groups.0.lr") == "0.01"
    assert _field(out, "state", "global_steps") == "0"


def test_nothing_is_printed_without_dump_state(capsys):
    model = _model()
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                                  config=CONFIG)
    engine.destroy()
    assert not engine.dump_state()
    assert "Engine state:" not in capsys.readouterr().out


def _rank_prints(tmp: str) -> None:
    import contextlib
    import os

    model = _model()
    with open(os.path.join(tmp, f"rank{os.environ['RANK']}.txt"), "w") as f, contextlib.redirect_stdout(f):
        engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config={**CONFIG, "dump_state": True, "bf16": {"enabled": False}})
        engine.destroy()


def test_only_rank_zero_prints(tmp_path):
    run_ranks(_rank_prints, 2, str(tmp_path), timeout=120)
    rank0 = (tmp_path / "rank0.txt").read_text()
    assert _field(rank0, "state", "world_size") == "2" and _field(rank0, "state", "train_batch_size") == "12"
    assert "Engine state:" not in (tmp_path / "rank1.txt").read_text()

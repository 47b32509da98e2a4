"""The tuning loop with trials faked (tuner.py), and the command line it builds (trial.py)."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from rich.console import Console

from dsrun.autotuning import trial as trial_module
from dsrun.autotuning import tuner
from dsrun.autotuning.prune import MemoryBudget, MemoryModel, prune
from dsrun.autotuning.space import Candidate, generate
from dsrun.autotuning.trial import (
    Job,
    TrialOutcome,
    dsrun_command,
    find_config_arg,
    script_args_for,
)
from dsrun.env import AUTOTUNING_RESULT
from dsrun.runtime.config import load_config
from tests.autotuning.helpers import MIB, result, write_result

SCRIPT = "train.py"


def test_config_argument_forms():
    assert find_config_arg(["--steps", "3", "--deepspeed_config", "c.json"]) == (3, "c.json")
    assert find_config_arg(["--config=c.yaml"]) == (0, "c.yaml")
    assert find_config_arg(["--deepspeed", "--deepspeed_config", "c.json"]) == (2, "c.json")
    assert find_config_arg(["--deepspeed", "ds.json"]) == (1, "ds.json")  # Hugging Face's form
    with pytest.raises(ValueError, match="needs the script's ds_config among its arguments"):
        find_config_arg(["--deepspeed", "--steps", "3"])


def test_trial_args_replace_the_config_and_apply_arg_mappings():
    args = ("--config=old.json", "--bs", "2", "--steps", "9")
    out = script_args_for(args, Path("/x/new.json"), {"train_micro_batch_size_per_gpu": 8,
                                                      "gradient_accumulation_steps": 4},
                          {"train_micro_batch_size_per_gpu": "--bs", "gradient_accumulation_steps": "--gas",
                           "activation_checkpointing": "--ckpt"}, True)
    assert out == ["--config=/x/new.json", "--bs", "8", "--steps", "9", "--gas", "4", "--ckpt", "true"]
    plain = script_args_for(("--deepspeed_config", "old.json"), Path("n.json"), {}, None, None)
    assert plain == ["--deepspeed_config", "n.json"]


def test_launcher_args_are_the_users_without_autotuning():
    argv = ["--autotuning", "tune", "--num_procs", "2", "--env", "A=1", SCRIPT, "--config", "c.json", "--num_procs"]
    job = Job.from_argv(argv, SCRIPT, ("--config", "c.json", "--num_procs"))
    assert job.launcher_args == ("--num_procs", "2", "--env", "A=1")
    assert Job.from_argv(["--autotuning=run", SCRIPT], SCRIPT, ()).launcher_args == ()
    assert dsrun_command(job, ["--config", "t.json"], ("--env", "X=1")) == [
        sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", "2", "--env", "A=1", "--env", "X=1", SCRIPT,
        "--config", "t.json"]


class FakeTrials:
    """Stands in for run_trial: records every launch; speed grows with the micro-batch size, the
    micro-batch 8 trials fail as a script that rejects them would."""

    def __init__(self) -> None:
        self.launched: list[str] = []

    def __call__(self, job, name, config, exps_dir, *, arg_mappings, activation_checkpointing, end_profile_step,
                 overwrite) -> TrialOutcome:
        assert config["autotuning"]["enabled"]
        self.launched.append(name)
        mbs = config.get("train_micro_batch_size_per_gpu", 2)
        if mbs == 8:
            return TrialOutcome("failed", None, "exit status 3: [rank 0] micro-batch 8 is too large", 1.0)
        stage = config.get("zero_optimization", {}).get("stage", 0)
        r = result(host_available=(200 * MIB, 200 * MIB), micro_batch=mbs, grad_accum=32 // (2 * mbs),
                   step_seconds=(1.0 / mbs + 0.01 * stage,))
        return TrialOutcome("ok", r, "", 1.0)


@pytest.fixture
def fake(monkeypatch):
    trials = FakeTrials()
    monkeypatch.setattr(tuner, "run_trial", trials)
    return trials


def write_config(tmp_path: Path, **autotuning) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "autotuning": {"enabled": True, "max_train_micro_batch_size_per_gpu": 16,
                       "num_tuning_micro_batch_sizes": 5, "results_dir": str(tmp_path / "results"),
                       "exps_dir": str(tmp_path / "exps"), **autotuning}}))
    return path


def test_pruned_candidates_are_never_launched_and_the_fastest_measured_wins(tmp_path, fake):
    path = write_config(tmp_path, tuner_early_stopping=50)
    console = Console(file=io.StringIO(), width=200)
    code = tuner.autotune("tune", Job(("--num_procs", "2"), SCRIPT, ("--deepspeed_config", str(path))), console)
    assert code == 0
    # What the memory model rules out for this baseline (see test_prune.py for the arithmetic).
    base = json.loads(path.read_text())
    tuning = tuner.tuning_section(base, path)
    r = result(host_available=(200 * MIB, 200 * MIB))
    _, ruled_out = prune(generate(tuning, base, 2), MemoryModel.from_baseline(r, Candidate(0, 2, 8), base, 2),
                         MemoryBudget.from_result(r))
    ruled_out = {c.name for c, _ in ruled_out}
    assert ruled_out and fake.launched[0] == "baseline"
    assert not ruled_out & set(fake.launched)
    failing = [n for n in fake.launched if "_mbs8_" in n]
    assert "z0_mbs4_gas4" in fake.launched and failing

    rows = json.loads((tmp_path / "results" / "summary.json").read_text())["trials"]
    by_name = {r["trial"]: r for r in rows if not r["baseline"]}
    assert {n for n, r in by_name.items() if r["status"] == "pruned"} == ruled_out
    assert all(by_name[n]["status"] == "failed" and "too large" in by_name[n]["reason"] for n in failing)
    measured = [r for r in rows if r["status"] == "ok"]
    best = max(measured, key=lambda r: r["samples_per_s"])
    assert best["best"] and best["trial"] == "z0_mbs4_gas4"
    cfg = load_config(tmp_path / "results" / "ds_config_optimal.json", world_size=2)
    assert (cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu, cfg.train_batch_size) == (0, 4, 32)
    assert failing[0] in (tmp_path / "results" / "summary").read_text()


def test_failed_baseline_stops_the_tuner_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(tuner, "run_trial", lambda *a, **k: TrialOutcome("failed", None, "out of memory", 2.0))
    path = write_config(tmp_path)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        assert tuner.autotune("tune", Job((), SCRIPT, ("--config", str(path))), Console(file=f, width=200)) == 1
    assert "the baseline trial (your own config) failed: out of memory" in out.read_text()


def test_bad_autotuning_section_and_missing_config_argument(tmp_path, fake):
    path = write_config(tmp_path, tuner_type="bayesian")
    with pytest.raises(click.UsageError, match="autotuning.tuner_type"):
        tuner.autotune("tune", Job((), SCRIPT, ("--config", str(path))), Console(file=io.StringIO()))
    with pytest.raises(click.UsageError, match="needs the script's ds_config"):
        tuner.autotune("tune", Job((), SCRIPT, ("--steps", "3")), Console(file=io.StringIO()))
    assert fake.launched == []


def test_run_mode_trains_with_the_optimal_config(tmp_path, fake, monkeypatch):
    calls = []
    monkeypatch.setattr(tuner.subprocess, "call", lambda argv: calls.append(argv) or 0)
    path = write_config(tmp_path, tuner_num_trials=2)
    job = Job(("--num_procs", "2"), SCRIPT, ("--deepspeed_config", str(path), "--steps", "100"))
    assert tuner.autotune("run", job, Console(file=io.StringIO())) == 0
    assert len(fake.launched) == 3  # the baseline and tuner_num_trials trials
    (argv,) = calls
    optimal = str(tmp_path / "results" / "ds_config_optimal.json")
    assert argv[-5:] == [SCRIPT, "--deepspeed_config", optimal, "--steps", "100"]
    assert not any(AUTOTUNING_RESULT.name in a for a in argv)


def test_trial_config_for_the_baseline_keeps_the_users_settings(tmp_path, fake, monkeypatch):
    configs = []

    def keep(job, name, config, exps_dir, **kw):
        configs.append(config)
        return fake(job, name, config, exps_dir, **kw)

    monkeypatch.setattr(tuner, "run_trial", keep)
    path = write_config(tmp_path, tuner_num_trials=1)
    tuner.autotune("tune", Job((), SCRIPT, ("--config", str(path))), Console(file=io.StringIO()))
    user = json.loads(path.read_text())
    assert configs[0] == {**user, "autotuning": {**user["autotuning"], "enabled": True}}
    assert configs[1]["zero_optimization"]["stage"] == 0 and configs[1]["train_batch_size"] == 32


def test_run_trial_launches_with_the_result_variable_and_reads_what_the_engine_wrote(tmp_path, monkeypatch):
    seen = []

    def fake_run(argv, stdout, stderr, stdin, check):
        seen.append(argv)
        env_value = argv[argv.index("--env") + 1]
        assert env_value.startswith(AUTOTUNING_RESULT.name + "=")
        config_path = Path(argv[argv.index("--deepspeed_config") + 1])
        if json.loads(config_path.read_text())["train_micro_batch_size_per_gpu"] == 8:
            stderr.write(b"[rank 1] Traceback (most recent call last):\n[rank 1] ValueError: no\n")
            return subprocess.CompletedProcess(argv, 1)
        write_result(Path(env_value.split("=", 1)[1]), result())
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(trial_module.subprocess, "run", fake_run)
    job = Job(("--num_procs", "2"), SCRIPT, ("--deepspeed_config", "user.json"))
    kw = {"arg_mappings": None, "activation_checkpointing": None, "end_profile_step": 5, "overwrite": True}
    ok = trial_module.run_trial(job, "z0_mbs2_gas8", {"train_micro_batch_size_per_gpu": 2}, tmp_path, **kw)
    assert ok.status == "ok" and ok.result == result()
    assert seen[0][:5] == [sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", "2"]
    assert (tmp_path / "z0_mbs2_gas8" / "cmd.txt").read_text().startswith(sys.executable)
    bad = trial_module.run_trial(job, "z0_mbs8_gas2", {"train_micro_batch_size_per_gpu": 8}, tmp_path, **kw)
    assert (bad.status, bad.reason) == ("failed", "exit status 1: [rank 1] ValueError: no")
    # overwrite false: a result already there is reused without a launch.
    again = trial_module.run_trial(job, "z0_mbs2_gas8", {"train_micro_batch_size_per_gpu": 2}, tmp_path,
                                   **{**kw, "overwrite": False})
    assert (again.status, again.reason, len(seen)) == ("ok", "reused", 2)


def test_flops_metric_without_token_inputs_says_so(tmp_path, fake):
    path = write_config(tmp_path, metric="flops", tuner_num_trials=1)
    out = io.StringIO()
    assert tuner.autotune("tune", Job((), SCRIPT, ("--config", str(path))), Console(file=out, width=300)) == 1
    assert "metric flops needs token ids" in out.getvalue()

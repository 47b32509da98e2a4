"""`dsrun --autotuning run --num_procs 2` on a small script: real trials, a failing one, then training."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsrun.runtime.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "tiny_train.py"


@pytest.mark.slow
def test_autotuning_run_on_two_ranks(tmp_path):
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2,
                             "min_train_micro_batch_size_per_gpu": 2, "max_train_micro_batch_size_per_gpu": 8,
                             "num_tuning_micro_batch_sizes": 2, "tuner_num_trials": 3}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # The script refuses micro-batches above 4: trial z0_mbs8_gas1 fails, the others run.
    proc = subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", "--autotuning", "run", "--num_procs", "2",
                           str(SCRIPT), "--deepspeed_config", "ds.json", "--max_micro_batch", "4", "--steps", "3"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = {r["trial"]: r for r in json.loads((tmp_path / "autotuning_results" / "summary.json").read_text())["trials"]}
    assert list(rows) == ["z0_mbs2_gas4", "z0_mbs4_gas2", "z0_mbs8_gas1", "z1_mbs2_gas4", "z1_mbs8_gas1",
                          "z2_mbs2_gas4", "z2_mbs8_gas1", "z3_mbs2_gas4", "z3_mbs8_gas1"]
    assert rows["z0_mbs2_gas4"]["baseline"]
    failed = rows["z0_mbs8_gas1"]
    assert failed["status"] == "failed"
    assert re.fullmatch(r"exit status 3: \[rank [01]\] micro-batch 8 is larger than --max_micro_batch 4",
                        failed["reason"])
    measured = [r for r in rows.values() if r["status"] == "ok"]
    assert len(measured) == 3  # the baseline, z0_mbs4_gas2, z1_mbs2_gas4; the rest skipped (tuner_num_trials)
    assert all(r["samples_per_s"] > 0 and r["peak_memory_bytes"] > 0 for r in measured)
    best = max(measured, key=lambda r: r["samples_per_s"])
    assert best["best"]
    assert "z0_mbs8_gas1" in proc.stderr and "micro-batch 8 is larger" in proc.stderr  # the progress lines

    optimal = load_config(tmp_path / "autotuning_results" / "ds_config_optimal.json", world_size=2)
    assert optimal.train_batch_size == 16 and not optimal.autotuning.enabled
    assert f"micro-batch {optimal.train_micro_batch_size_per_gpu}" in best["setting"]
    assert "[rank 0] trained 3 steps" in proc.stdout  # `run` trained with the optimal config
    for name in ("z0_mbs4_gas2", "z0_mbs8_gas1"):
        assert (tmp_path / "autotuning_exps" / name / "ds_config.json").is_file()

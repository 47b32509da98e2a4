"""DeepSpeed-style scripts run unchanged under `dsrun` with 2 ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_helpers import free_port

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def dsrun(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # a port of our own: 29500 may be taken between dsrun's check and rank 0's bind by parallel jobs
    return subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", "--master_port", str(free_port()), *args],
                          cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def results(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        _, _, rest = line.partition("] ")
        if rest.startswith("RESULT "):
            record = json.loads(rest[len("RESULT "):])
            out[record["rank"]] = record
    return out


@pytest.mark.parametrize("config,stage,bf16", [("tutorial_fp32.json", 0, False),
                                               ("tutorial_zero3_bf16.json", 3, True)])
def test_tutorial_script(tmp_path, config, stage, bf16):
    run = dsrun("--num_procs", "2", str(SCRIPTS / "tutorial_train.py"), "--deepspeed",
                "--deepspeed_config", str(SCRIPTS / config), "--save_dir", str(tmp_path / "ckpt"), cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = results(run.stdout)
    assert sorted(got) == [0, 1]
    for rank, r in got.items():
        assert r["local_rank_arg"] == rank  # the launcher passed --local_rank, the script did not fall back to -1
        assert r["world"] == 2 and r["stage"] == r["config_stage"] == stage and r["bf16"] is bf16
        assert r["global_steps"] == 16
        assert r["last_mean"] < 0.75 * r["first"], r  # it learned
    assert got[0]["last_mean"] == got[1]["last_mean"]
    assert "mean loss over ranks" in run.stdout and "after training | MA" in run.stdout
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step16"


def test_script_rejecting_local_rank_gets_a_hint(tmp_path):
    run = dsrun("--num_procs", "2", str(SCRIPTS / "rejects_local_rank.py"), cwd=tmp_path, timeout=120)
    assert run.returncode == 2
    assert "unrecognized arguments: --local_rank" in run.stderr
    assert "pass --no_local_rank to dsrun" in " ".join(run.stderr.split())  # rich wraps lines
    ok = dsrun("--num_procs", "2", "--no_local_rank", str(SCRIPTS / "rejects_local_rank.py"), cwd=tmp_path,
               timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("parsed Namespace(steps=1)") == 2

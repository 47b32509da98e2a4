"""`dsrun --max_restarts` losing a node: 2 SSH nodes x 2 ranks, node-b unreachable on the restart.

A rank of node-b SIGKILLs itself in step 4 of the first attempt, just after
pointing node-b's entry of the launcher's ssh config at a port where nothing
listens: to the restart's pre-check node-b is then down (connection
refused), as a crashed node is. The launcher drops it, naming it and why,
and restarts on node-a's 2 ranks; the script auto-resumes step 3's
checkpoint (written by 4 ranks, resharded to 2) with train_batch_size fixed,
so gradient accumulation goes from 2 to 4 micro-batches and every step sees
the same 8 samples as on 4 ranks. Only the order of float sums changes,
so losses and weights match an uninterrupted 4-rank run within LOSS_RTOL.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multinode.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/faults/scripts/restart_train.py"
STEPS = 6
# Relative tolerance on losses and weights: float32 sums over 2 instead of 4 ranks, through 6 Adam steps.
LOSS_RTOL = 1e-4
pytestmark = pytest.mark.slow


def dsrun(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", "--no_local_rank", *args], check=False,
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def records(path: Path) -> tuple[list[dict], list[float]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    final = next(r["final"] for r in lines if "final" in r)
    return [r for r in lines if "step" in r], [v for p in final for v in (p if isinstance(p, list) else [p])]


def run_losing_node_b(sshd_cluster, tmp_path: Path, *script_args: str) -> tuple[str, Path, Path]:
    """A 4-rank local reference run, then 2 SSH nodes x 2 ranks with --max_restarts 1 where rank 3 (on
    node-b) dies in step 4 after pointing node-b's ssh config entry at a dead port, so the restart's
    pre-check drops node-b. Returns (the second run's output, its records, the reference's records);
    asserts both runs succeeded."""
    whole = tmp_path / "whole.jsonl"
    ref = dsrun(["--num_procs", "4", "--master_port", str(free_port()), SCRIPT, str(tmp_path / "whole-ckpt"),
                 str(whole), str(STEPS), "step", *script_args])
    assert ref.returncode == 0, ref.stderr[-3000:]

    live, down = tmp_path / "ssh_config", tmp_path / "ssh_config.node-b-down"
    live.write_text(sshd_cluster.ssh_config.read_text())
    node_a = sshd_cluster.write_config(f"{tmp_path.name}-a", {"node-a": "127.0.0.1"})
    node_b = sshd_cluster.write_config(f"{tmp_path.name}-b", {"node-b": "127.0.0.2"}, port=free_port("127.0.0.2"))
    down.write_text(node_a.read_text() + node_b.read_text())
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    cut = tmp_path / "cut.jsonl"
    run = dsrun(["--hostfile", str(hosts), "--ssh_config", str(live), "--max_restarts", "1", SCRIPT,
                 str(tmp_path / "cut-ckpt"), str(cut), str(STEPS), "step", *script_args, "--die", "3:4",
                 "--down_config", str(down), str(live)])
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    return log, cut, whole


def test_restart_without_the_lost_node_keeps_the_global_batch(sshd_cluster, tmp_path):
    log, cut, whole = run_losing_node_b(sshd_cluster, tmp_path)
    assert "dsrun: dropping host node-b: connection refused at 127.0.0.2:" in log, log[-3000:]
    # rank 3's SIGKILL is the root cause even when a peer's broken collective reaches the launcher
    # first (see [Note: root cause order] in dsrun/launcher/failure.py).
    assert "restart 1/1 after rank 3 on node-b ended with SIGKILL: on 1 host(s): node-a" in log, log[-3000:]
    assert "auto_resume: resumed from step 3" in log and "on 2 rank(s)" in log, log[-3000:]

    steps, weights = records(cut)
    ref_steps, ref_weights = records(whole)
    assert [(r["step"], r["world"], r["restart"]) for r in steps] == [
        (1, 4, 0), (2, 4, 0), (3, 4, 0), (4, 2, 1), (5, 2, 1), (6, 2, 1)]
    # (the 4-rank attempt sums over SSH nodes in another order than the local reference run: not bitwise either)
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in ref_steps], rel=LOSS_RTOL)
    assert weights == pytest.approx(ref_weights, rel=LOSS_RTOL, abs=1e-6)

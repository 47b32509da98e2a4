"""`dsrun-sbatch --requeue` with `checkpoint.auto_resume` in the test Slurm cluster (conftest.slurm_cluster):
a job whose first run fails after checkpointing is requeued by Slurm and resumes from its checkpoint.

The job is tests/faults/scripts/restart_train.py on 2 nodes x 1 rank, with a
checkpoint after every step; in the first run (SLURM_RESTART_COUNT unset or
0) rank 1 SIGKILLs itself in step 4. dsrun ends the run (no --max_restarts:
Slurm is the one restarting here), the sbatch script requeues the job, and
Slurm runs it again after its requeue delay (6 s in the test cluster: see
conftest [Note: how long a requeued job waits]) with SLURM_RESTART_COUNT=1: auto_resume loads step 3's checkpoint
and the job completes steps 4-6. Same world size and the loader's position
and RNG states restored, so the losses are those of an uninterrupted run of
the same job, bit for bit (compared with one run under salloc).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.multinode.test_slurm_launch import run, wait_for_job

SCRIPT = "tests/faults/scripts/restart_train.py"
STEPS = 6
pytestmark = pytest.mark.slow


def records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "step" in r]


def test_requeued_job_resumes_from_its_checkpoint(slurm_cluster, tmp_path):
    """The uninterrupted reference run (under salloc) runs while Slurm runs, requeues and reruns the batch
    job (each node has a CPU for each job): the requeue delay and the launches' waits overlap with it."""
    out, cut = tmp_path / "job.out", tmp_path / "cut.jsonl"
    proc = run([sys.executable, "-m", "dsrun.launcher.sbatch", "--nodes", "2", "--ranks-per-node", "1", "--time", "5",
                "--requeue", "--max-requeues", "1", "--job-name", "resume", "--output", str(out), "--script",
                str(tmp_path / "resume.sbatch"), "--dsrun-arg=--grace_period=2", "--dsrun-arg=--no_local_rank",
                "--submit", SCRIPT, str(tmp_path / "cut-ckpt"), str(cut), str(STEPS), "loader", "--die", "1:4"],
               slurm_cluster)
    assert proc.returncode == 0, proc.log
    job_id = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)

    whole = tmp_path / "whole.jsonl"
    ref = run(["salloc", "-N2", "--ntasks-per-node=1", sys.executable, "-m", "dsrun.launcher.cli", "--launcher",
               "slurm", "--no_local_rank", SCRIPT, str(tmp_path / "whole-ckpt"), str(whole), str(STEPS), "loader"],
              slurm_cluster)
    assert ref.returncode == 0, ref.log

    state = wait_for_job(job_id, slurm_cluster, timeout=240)
    text = out.read_text()
    assert state == "COMPLETED", text + slurm_cluster.log_tail()
    assert "requeueing job" in text and "requeue 1 of 1" in text, text
    assert "auto_resume: no complete checkpoint" in text and "auto_resume: resumed from step 3" in text, text
    steps = records(cut)
    assert [(r["step"], r["slurm_restart"], r["world"]) for r in steps] == [
        (1, 0, 2), (2, 0, 2), (3, 0, 2), (4, 1, 2), (5, 1, 2), (6, 1, 2)], text
    assert [r["loss"] for r in steps] == [r["loss"] for r in records(whole)]  # bitwise

"""dsrun under a real two-node Slurm (see conftest.slurm_cluster): salloc, the generated sbatch script, srun per rank."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multinode.conftest import expected_losses

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/multinode/scripts/allreduce_train.py"
pytestmark = pytest.mark.slow


def losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^(?:\[rank 0\] )?LOSS \d+ (\S+)$", out, re.M)]


def run(cmd: list[str], cluster, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=timeout)
    proc.log = f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{cluster.log_tail()}"
    return proc


def test_dsrun_launcher_slurm_inside_salloc(slurm_cluster):
    """Sum order of the all-reduce differs from the one-process batch mean: equal to 1e-5 relative."""
    proc = run(["salloc", "-N2", "--ntasks-per-node=2", sys.executable, "-m", "dsrun.launcher.cli",
                "--launcher", "slurm", SCRIPT, "--steps", "3"], slurm_cluster)
    assert proc.returncode == 0, proc.log
    assert losses(proc.stdout) == pytest.approx(expected_losses(3), rel=1e-5), proc.log
    nodes = dict(re.findall(r"^\[rank (\d)\] WHERE .* slurm_node=(\S+)", proc.stdout, re.M))
    assert nodes == {"0": "n1", "1": "n1", "2": "n2", "3": "n2"}, proc.log


def wait_for_job(job_id: str, cluster, timeout: float = 120) -> str:
    """Poll scontrol until the job has ended; returns its JobState (sbatch --wait polls too slowly for a test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = re.search(r"JobState=(\w+)", run(["scontrol", "show", "job", "-o", job_id], cluster).stdout)
        if state and state.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state.group(1)
        time.sleep(0.3)
    pytest.fail(f"Slurm job {job_id} did not end within {timeout}s\n{cluster.log_tail()}")


def test_sbatch_script_runs_and_failing_rank_fails_the_job(slurm_cluster, tmp_path):
    """One rank per node keeps this cheap; the script and the job are the same as with more.
    Both jobs are submitted before either is waited for: each node has a CPU for each."""
    def submit(name: str, *script_args: str) -> str:
        out = tmp_path / f"{name} #1.out"  # quoted in the #SBATCH line: sbatch's own parser must undo it
        proc = run([sys.executable, "-m", "dsrun.launcher.sbatch", "--nodes", "2", "--ranks-per-node", "1",
                    "--time", "5", "--job-name", name, "--output", str(out), "--script", str(tmp_path / f"{name}.sbatch"),
                    "--dsrun-arg=--grace_period=3", "--submit", SCRIPT, *script_args], slurm_cluster)
        assert proc.returncode == 0, proc.log
        return re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)

    def wait(name: str, job_id: str) -> tuple[str, str]:
        out = tmp_path / f"{name} #1.out"
        state = wait_for_job(job_id, slurm_cluster)
        return state, out.read_text() if out.exists() else ""

    ok, bad = submit("ok", "--steps", "2"), submit("bad", "--mode", "fail", "--fail_rank", "1", "--steps", "2")
    state, out = wait("ok", ok)
    assert state == "COMPLETED", out + slurm_cluster.log_tail()
    assert "--launcher slurm" in (tmp_path / "ok.sbatch").read_text()
    assert losses(out) == pytest.approx(expected_losses(2), rel=1e-5), out

    state, out = wait("bad", bad)
    assert state == "FAILED", out + slurm_cluster.log_tail()
    assert "RuntimeError: injected failure on rank 1" in out


def test_srun_one_task_per_rank_finds_its_rank(slurm_cluster):
    """srun starting every rank itself: dsrun.init_distributed() reads SLURM_PROCID/SLURM_LOCALID/SLURM_STEP_NUM_TASKS."""
    proc = run(["srun", "-N2", "--ntasks-per-node=2", "--kill-on-bad-exit=1", sys.executable, "-u", SCRIPT,
                "--dsrun_init", "--steps", "2"], slurm_cluster)
    assert proc.returncode == 0, proc.log
    assert losses(proc.stdout) == pytest.approx(expected_losses(2), rel=1e-5), proc.log
    where = re.findall(r"WHERE rank=(\d) local_rank=(\d) .* slurm_node=(\S+)", proc.stdout)
    assert sorted(where) == [("0", "0", "n1"), ("1", "1", "n1"), ("2", "0", "n2"), ("3", "1", "n2")], proc.log


REQUEUE_RANK = """\
import os, sys, time
restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
print(f"RUN rank={os.environ['RANK']} restart={restarts}", flush=True)
if restarts == 0 and sys.argv[1] == "fail":
    sys.exit(3)
if restarts == 0 and sys.argv[1] == "sleep":
    time.sleep(300)
"""


@pytest.mark.parametrize("first_run", ["fail", "sleep"])
def test_requeue_reruns_the_job(slurm_cluster, tmp_path, first_run):
    """--requeue: a failed run (or one stopped by the --signal lead-time signal) requeues the job, which runs again.

    The signal is sent by hand (`scancel --batch --signal USR1`): waiting for
    a real time limit would take minutes.
    """
    script, out = tmp_path / "rank.py", tmp_path / "job.out"
    script.write_text(REQUEUE_RANK)
    proc = run([sys.executable, "-m", "dsrun.launcher.sbatch", "--nodes", "2", "--ranks-per-node", "1", "--time", "5",
                "--requeue", "--max-requeues", "1", "--signal", "60", "--job-name", f"rq-{first_run}", "--output",
                str(out), "--script", str(tmp_path / "rq.sbatch"), "--dsrun-arg=--grace_period=2", "--submit",
                str(script), first_run], slurm_cluster)
    assert proc.returncode == 0, proc.log
    job_id = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    if first_run == "sleep":
        deadline = time.monotonic() + 60
        while (not out.exists() or out.read_text().count("restart=0") < 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run(["scancel", "--batch", "--signal", "USR1", job_id], slurm_cluster).returncode == 0
    state = wait_for_job(job_id, slurm_cluster, timeout=240)
    text = out.read_text()
    assert state == "COMPLETED", text + slurm_cluster.log_tail()
    runs = re.findall(r"RUN rank=(\d) restart=(\d)", text)
    assert any(r[1] == "0" for r in runs) and sorted(r for r in runs if r[1] == "1") == [("0", "1"), ("1", "1")], text
    assert "requeueing job" in text and "requeue 1 of 1" in text, text
    restarts = re.search(r"Restarts=(\d+)", run(["scontrol", "show", "job", "-o", job_id], slurm_cluster).stdout)
    assert restarts and restarts.group(1) == "1"


def test_drained_node_is_left_out_of_the_launch(slurm_cluster):
    """A node taken out of service inside the allocation gets no agent: the job runs on the other node."""
    drain_n2 = "scontrol update NodeName=n2 State=DRAIN Reason=dsrun-test"
    try:
        proc = run(["salloc", "-N2", "--ntasks-per-node=2", "bash", "-c",
                    f'{drain_n2} && exec "$@"', "-", sys.executable, "-m", "dsrun.launcher.cli", "--launcher", "slurm",
                    SCRIPT, "--steps", "2"], slurm_cluster)
    finally:
        run(["scontrol", "update", "NodeName=n2", "State=RESUME"], slurm_cluster)
    assert proc.returncode == 0, proc.log
    assert re.search(r"leaving out node n2: Slurm reports it drain", proc.stderr), proc.log
    nodes = dict(re.findall(r"^\[rank (\d)\] WHERE .* slurm_node=(\S+)", proc.stdout, re.M))
    assert nodes == {"0": "n1", "1": "n1"}, proc.log

"""End-to-end launches over a real sshd: two "nodes" (127.0.0.1 and 127.0.0.2) with 2 slots each.

Every dsrun run here goes through paramiko to sshd, which starts the agent
on each node; ranks of node-b really run in sshd sessions reached at
127.0.0.2 (each rank reports the address from SSH_CONNECTION).
"""
from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.multinode.conftest import expected_losses, free_port, keygen

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/multinode/scripts/allreduce_train.py"
SECRET = "hf_s3cr3t-value-0123456789"
pytestmark = pytest.mark.slow


def dsrun(args: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_TOKEN=SECRET)
    return subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, **kw)


def hostfile(tmp_path: Path, text: str = "node-a slots=2\nnode-b slots=2\n") -> str:
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^\[rank 0\] LOSS \d+ (\S+)$", out, re.M)]


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie has exited; only its parent has not collected the status yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def job_processes(sshd_cluster) -> list[int]:
    """Pids of everything running under our sshd: sessions, agents and ranks of the job."""
    return [p.pid for p in psutil.Process(sshd_cluster.proc.pid).children(recursive=True)]


def left_after(pids: list[int], since: float, limit: float = 10.0) -> list[int]:
    """The pids still alive `limit` seconds after `since` (returns as soon as none is)."""
    while [p for p in pids if alive(p)] and time.monotonic() - since < limit:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


GPT_ARGS = ["examples/train_gpt.py", "--config", "examples/configs/gpt_demo.json", "--steps", "3", "--n_layer", "1",
            "--n_embd", "32", "--n_head", "2", "--seq_len", "32", "--log_every", "1", "--eval_batches", "1"]


def test_gpt_example_two_nodes_matches_local_run(sshd_cluster, tmp_path):
    """The GPT example, 4 ranks on 2 SSH nodes vs 4 local ranks: same data, same all-reduce order, same losses."""
    remote = dsrun(["--hostfile", hostfile(tmp_path), "--ssh_config", str(sshd_cluster.ssh_config), *GPT_ARGS])
    assert remote.returncode == 0, remote.stdout[-2000:] + remote.stderr
    local = dsrun(["--num_procs", "4", *GPT_ARGS])
    assert local.returncode == 0, local.stdout[-2000:] + local.stderr

    def curve(out: str) -> list[str]:
        return re.findall(r"^\[rank 0\] (?:step \d+/\d+ +loss \S+|validation loss.*)", out, re.M)

    assert len(curve(remote.stdout)) == 5, remote.stdout
    assert [re.sub(r" +", " ", c) for c in curve(remote.stdout)] == [re.sub(r" +", " ", c) for c in curve(local.stdout)]


def test_two_nodes_train_and_keep_secrets(sshd_cluster, tmp_path):
    """4 ranks on 2 SSH nodes reach the one-process losses (all-reduce sums in another order: 1e-5 relative)."""
    remote = dsrun(["--hostfile", hostfile(tmp_path), "--ssh_config", str(sshd_cluster.ssh_config),
                    "--print_env", SCRIPT, "--steps", "4"])
    assert remote.returncode == 0, remote.stderr
    assert losses(remote.stdout) == pytest.approx(expected_losses(4), rel=1e-5)

    where = dict(re.findall(r"^\[rank (\d)\] WHERE .* via=(\S+) ", remote.stdout, re.M))
    assert where == {"0": "127.0.0.1", "1": "127.0.0.1", "2": "127.0.0.2", "3": "127.0.0.2"}
    # The secret reached every rank, but no command line, output or sshd log.
    shas = re.findall(r"secret_sha=(\w+)", remote.stdout)
    assert shas == [hashlib.sha256(SECRET.encode()).hexdigest()[:12]] * 4
    assert "secret_in_cmdline=True" not in remote.stdout
    assert re.search(r"HF_TOKEN=<\d+ chars>", remote.stderr), remote.stderr
    assert SECRET not in remote.stdout + remote.stderr + sshd_cluster.log.read_text()
    assert not left_after(job_processes(sshd_cluster), time.monotonic(), 5)


def start_sleeping_job(sshd_cluster, tmp_path) -> tuple[subprocess.Popen, Path]:
    """dsrun with 4 sleeping ranks on 2 SSH nodes; returns once every rank wrote its pid."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    args = [sys.executable, "-m", "dsrun.launcher.cli", "--hostfile", hostfile(tmp_path), "--ssh_config",
            str(sshd_cluster.ssh_config), "--grace_period", "3", SCRIPT, "--mode", "sleep", "--piddir", str(piddir)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(piddir.glob("*.pid"))) < 4:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"ranks did not start: {proc.communicate()}")
        time.sleep(0.1)
    return proc, piddir


def test_killed_rank_on_second_node_ends_job(sshd_cluster, tmp_path):
    proc, piddir = start_sleeping_job(sshd_cluster, tmp_path)
    job = job_processes(sshd_cluster)
    try:
        os.kill(int((piddir / "rank_3.pid").read_text()), signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert elapsed < 10, f"job took {elapsed:.1f}s to end"
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert re.search(r"rank\D+3", err) and "SIGKILL" in err and "node-b" in err, err
    assert not left_after(job, killed_at), "processes of the job remain"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_dsrun_stops_every_node(sshd_cluster, tmp_path, signum):
    """SIGTERM: dsrun tears the job down. SIGKILL: the connections drop and each agent kills its ranks on EOF."""
    proc, piddir = start_sleeping_job(sshd_cluster, tmp_path)
    # Every process of the job on both nodes: the sshd sessions, agents and ranks.
    job = [p.pid for p in psutil.Process(sshd_cluster.proc.pid).children(recursive=True)]
    assert len(job) >= 6
    proc.send_signal(signum)
    sent_at = time.monotonic()
    try:
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (128 + signum, -signum)
    left = left_after(job, sent_at)
    assert not left, f"left behind 10 s after {signum.name}: {[psutil.Process(p).cmdline() for p in left]}"


def test_remote_traceback_is_root_cause(sshd_cluster, tmp_path):
    run = dsrun(["--hostfile", hostfile(tmp_path), "--ssh_config", str(sshd_cluster.ssh_config),
                 "--grace_period", "3", SCRIPT, "--mode", "fail", "--fail_rank", "2", "--steps", "2"])
    assert run.returncode == 1, run.stderr
    assert "RuntimeError: injected failure on rank 2" in run.stderr
    assert "Traceback (most recent call last)" in run.stderr
    assert not left_after(job_processes(sshd_cluster), time.monotonic(), 5)


def test_unreachable_and_wrong_key_stop_before_start(sshd_cluster, tmp_path):
    wrong = keygen(tmp_path / "wrong_key")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(sshd_cluster.write_config("e2e_good", {"node-a": "127.0.0.1"}).read_text()
                   + sshd_cluster.write_config("e2e_bad", {"node-b": "127.0.0.2"}, identity=wrong).read_text()
                   + sshd_cluster.write_config("e2e_down", {"node-c": "127.0.0.3"}, port=free_port("127.0.0.3")).read_text())
    run = dsrun(["--hostfile", hostfile(tmp_path, "node-a slots=1\nnode-b slots=1\nnode-c slots=1\n"),
                 "--ssh_config", str(cfg), SCRIPT])
    assert run.returncode != 0
    assert "WHERE" not in run.stdout  # no rank started anywhere
    err = " ".join(run.stderr.split())
    assert "authentication failed" in err and "connection refused" in err and "no rank was started" in err, run.stderr


@pytest.mark.parametrize("hosts, extra, words", [
    ("node-a slots=2\nnode-b slots=two\n", [], "hosts:2:8: expected 'slots=N'"),
    ("node-a slots=2\nnode-a slots=2\n", [], "hosts:2:1: host 'node-a' is listed twice"),
    ("node-a slots=2\n", ["--include", "node-a:2"], "slot 2 is beyond host 'node-a'"),
    ("node-a slots=2\n", ["--include", "node-a", "--exclude", "node-a:1"], "cannot be used together"),
    (None, [], "does not exist"),
])
def test_bad_hostfile_and_filters_fail_before_connecting(sshd_cluster, tmp_path, hosts, extra, words):
    path = hostfile(tmp_path, hosts) if hosts is not None else str(tmp_path / "missing")
    run = dsrun(["--hostfile", path, "--ssh_config", str(sshd_cluster.ssh_config), *extra, SCRIPT], timeout=60)
    assert run.returncode == 2, run.stderr
    assert words in " ".join(run.stderr.replace("│", " ").split()), run.stderr
    assert "WHERE" not in run.stdout


def test_dry_run_prints_placement(tmp_path):
    run = dsrun(["--hostfile", hostfile(tmp_path, "node[01-03] slots=4\n"), "--exclude", "node02@node03:0,1",
                 "--dry_run", "--print_env", SCRIPT], timeout=60)
    assert run.returncode == 0, run.stderr
    assert "world size 6" in run.stderr and "node03" in run.stderr and "node02" not in run.stderr.split("environment")[0]
    assert "HF_TOKEN=<" in run.stderr and SECRET not in run.stderr

"""The SSH launcher at scale: 64 hosts x 2 ranks over one real loopback sshd, a 1024-host dry run, the connection bound.

The hosts are aliases host-000 ... host-063 of 127.0.0.1 and 127.0.0.2
(tests/multinode/sshd.py `write_many_hosts`): dsrun opens one SSH
connection, one session and one agent per alias, as it would per machine.
Time bounds are 3x the goals of issue 28 (fail-fast < 10 s, dry run < 2 s)
and 4x for start-up (< 15 s): here all 64 "nodes" share the test machine's
CPUs (about 0.6 CPU-s per node: login shell, agent, ranks), and on a shared
2-core machine at load average 30 start-up took 33-44 s;
bench/launcher/fanout.py reports the real figures.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from dsrun.launcher import ssh
from dsrun.launcher.ssh import SshConnectError, connect_all, load_ssh_config
from tests.multinode.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = """\
import os, sys, time
e = os.environ
print("UP", e["RANK"], e["WORLD_SIZE"], e["NODE_RANK"], e["LOCAL_RANK"], flush=True)
while int(e["RANK"]) != int(e["WORLD_SIZE"]) - 1 or not os.path.exists(sys.argv[1]):
    time.sleep(0.01 if int(e["RANK"]) == int(e["WORLD_SIZE"]) - 1 else 60)
sys.exit(7)
"""


def dsrun(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_64_hosts_start_and_fail_fast(sshd_cluster, tmp_path):
    """128 ranks on 64 SSH hosts start with the right RANK/WORLD_SIZE; one rank's failure ends them all."""
    cfg, hostfile = sshd_cluster.write_many_hosts(64, 2)
    script, trigger = tmp_path / "rank.py", tmp_path / "fail_now"
    script.write_text(RANK_SCRIPT)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.cli", "--hostfile", str(hostfile), "--ssh_config",
                             str(cfg), "--no_local_rank", "--grace_period", "5", "--master_port", str(free_port()),
                             str(script), str(trigger)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    up: dict[int, tuple[int, ...]] = {}
    all_up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if m := re.match(r"\[rank (\d+)\] UP (\d+) (\d+) (\d+) (\d+)$", line.strip()):
                up[int(m.group(1))] = tuple(map(int, m.group(2, 3, 4, 5)))
                if len(up) == 128:
                    all_up.set()

    err: list[str] = []
    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True).start()
    try:
        assert all_up.wait(60), f"{len(up)} of 128 ranks up after 60 s; rc {proc.poll()}; {''.join(err)[-3000:]}"
        start_s = time.monotonic() - started
        assert up == {r: (r, 128, r // 2, r % 2) for r in range(128)}
        job = [p.pid for p in psutil.Process(sshd_cluster.proc.pid).children(recursive=True)]
        assert len(job) >= 64 + 128  # a session and an agent per host, the ranks
        trigger.touch()
        failed_at = time.monotonic()
        proc.wait(30)
        while [p for p in job if alive(p)] and time.monotonic() - failed_at < 30:
            time.sleep(0.05)
        fail_s = time.monotonic() - failed_at
        left = [p for p in job if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not left, f"left 30 s after the failure: {len(left)} processes"
    assert fail_s < 30, f"the job took {fail_s:.1f} s to end after rank 127 failed"
    assert proc.returncode == 7, err
    assert "127" in err[0] and "host-063" in err[0], err[0][-2000:]
    print(f"start-up {start_s:.1f} s, fail-fast {fail_s:.1f} s")


def test_dry_run_of_1024_hosts_is_fast(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"host-{i:04d} slots=8\n" for i in range(1024)))
    started = time.monotonic()
    run = dsrun(["--hostfile", str(hostfile), "--dry_run", "tests/multinode/scripts/allreduce_train.py"])
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-2000:]
    assert "world size 8192" in run.stderr and "host-1023" in run.stderr
    assert elapsed < 6, f"dry run of 1024 hosts took {elapsed:.1f} s"


def test_ssh_parallelism_must_be_positive(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\n")
    run = dsrun(["--hostfile", str(hostfile), "--ssh_parallelism", "0", "tests/multinode/scripts/allreduce_train.py"])
    assert run.returncode == 2 and "--ssh_parallelism" in run.stderr and "0" in run.stderr, run.stderr
    with pytest.raises(ValueError, match="--ssh_parallelism 0: give the number of hosts"):
        connect_all(["node-a"], load_ssh_config(None), None, parallelism=0)


@pytest.mark.slow
def test_connections_bounded_and_failed_host_named(sshd_cluster, monkeypatch):
    """12 hosts with --ssh_parallelism 3: never more than 3 handshakes at once; the one bad host is named alone."""
    cfg_path, _ = sshd_cluster.write_many_hosts(12, 1)
    # host-007 points at a port where nothing listens.
    text = cfg_path.read_text().replace(
        f"Host host-007\n    HostName 127.0.0.2\n    Port {sshd_cluster.port}",
        f"Host host-007\n    HostName 127.0.0.2\n    Port {free_port('127.0.0.2')}")
    assert text != cfg_path.read_text()
    cfg_path.write_text(text)
    in_flight, peak, lock = [0], [0], threading.Lock()
    connect = ssh._Connector.connect

    def counted(self, target, depth=0):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            time.sleep(0.05)  # keep the handshakes overlapping
            return connect(self, target, depth)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(ssh._Connector, "connect", counted)
    hosts = [f"host-{i:03d}" for i in range(12)]
    with pytest.raises(SshConnectError) as e:
        connect_all(hosts, load_ssh_config(cfg_path), None, parallelism=3)
    assert peak[0] == 3
    assert list(e.value.failures) == ["host-007"]
    assert "connection refused at 127.0.0.2" in e.value.failures["host-007"]
    assert "host-007 (" in str(e.value) and "no rank was started" in str(e.value)

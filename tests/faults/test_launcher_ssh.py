"""SSH host keys and a silent host against a real sshd on loopback (issue 11, items 5 and 10).

Uses the session's OpenSSH server (`sshd_cluster`, tests/conftest.py): node-a is
127.0.0.1, node-b 127.0.0.2, both with the same host key.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import paramiko
import pytest

from dsrun.launcher.ssh import HostKeyPolicy, SshConnectError, connect_all, load_ssh_config, resolve_target
from tests.multinode.sshd import keygen

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _close(conns) -> None:
    for conn in conns.values():
        conn.close()


def _config(cluster, tmp_path: Path, extra: str = "", known: Path | None = None) -> tuple[Path, Path]:
    """An ssh config for node-a with its own (empty) user known_hosts; returns (config, known_hosts)."""
    known = known or tmp_path / "user_known_hosts"
    return cluster.write_config(f"cfg_{tmp_path.name}", {"node-a": "127.0.0.1"}, known_hosts=known, extra=extra), known


def _dsrun(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_key_that_differs_from_the_global_known_hosts_is_refused(sshd_cluster, tmp_path):
    """The probe: a global entry with another key; dsrun connected, added the key and sent the job."""
    fake = keygen(tmp_path / "impostor").with_suffix(".pub").read_text().split()
    global_file = tmp_path / "ssh_known_hosts"
    global_file.write_text(f"[127.0.0.1]:{sshd_cluster.port} {fake[0]} {fake[1]}\n")
    cfg, known = _config(sshd_cluster, tmp_path, extra=f"GlobalKnownHostsFile {global_file}")
    for policy in (HostKeyPolicy.ACCEPT_NEW, HostKeyPolicy.STRICT, None):
        with pytest.raises(SshConnectError) as e:
            connect_all(["node-a"], load_ssh_config(cfg), policy)
        why = e.value.failures["node-a"]
        assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in why and str(global_file) in why, why
        assert "Host key verification failed" in why
    assert not known.exists()  # nothing learned from a refused host


def test_every_known_hosts_file_is_consulted_by_default():
    target = resolve_target("somehost", paramiko.SSHConfig())
    assert [str(p) for p in target.global_known_hosts] == ["/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2"]
    assert [p.name for p in target.user_known_hosts] == ["known_hosts", "known_hosts2"]
    assert target.strict_host_key_checking is None  # so: strict, as OpenSSH without a terminal


def test_a_key_listed_only_in_the_global_file_is_known(sshd_cluster, tmp_path):
    global_file = tmp_path / "ssh_known_hosts"
    global_file.write_text(sshd_cluster.known_hosts.read_text())
    cfg, known = _config(sshd_cluster, tmp_path, extra=f"GlobalKnownHostsFile {global_file}")
    _close(connect_all(["node-a"], load_ssh_config(cfg), HostKeyPolicy.STRICT))
    assert not known.exists()


def test_unknown_hosts_are_refused_by_default_unless_the_config_or_flag_accepts(sshd_cluster, tmp_path):
    cfg, known = _config(sshd_cluster, tmp_path)
    with pytest.raises(SshConnectError) as e:
        connect_all(["node-a"], load_ssh_config(cfg), None)
    why = e.value.failures["node-a"]
    assert f"No ED25519 host key is known for [127.0.0.1]:{sshd_cluster.port}" in why
    assert "you have requested strict checking" in why and "--ssh_host_key_policy accept-new" in why
    # StrictHostKeyChecking from the ssh config decides when the flag is not given ...
    cfg_yes, _ = _config(sshd_cluster, tmp_path, extra="StrictHostKeyChecking yes")
    with pytest.raises(SshConnectError, match="requested strict checking"):
        connect_all(["node-a"], load_ssh_config(cfg_yes), None)
    cfg_new, _ = _config(sshd_cluster, tmp_path, extra="StrictHostKeyChecking accept-new")
    _close(connect_all(["node-a"], load_ssh_config(cfg_new), None))
    assert known.read_text().split()[0] == f"[127.0.0.1]:{sshd_cluster.port}"
    # ... and the flag overrides it.
    known.unlink()
    with pytest.raises(SshConnectError, match="requested strict checking"):
        connect_all(["node-a"], load_ssh_config(cfg_new), HostKeyPolicy.STRICT)


def test_dsrun_refuses_an_unknown_host_without_the_flag(sshd_cluster, tmp_path):
    cfg, known = _config(sshd_cluster, tmp_path)
    (tmp_path / "hosts").write_text("node-a slots=1\n")
    run = _dsrun("--hostfile", str(tmp_path / "hosts"), "--ssh_config", str(cfg),
                 "tests/multinode/scripts/allreduce_train.py", "--steps", "1")
    assert run.returncode != 0
    assert "requested strict checking" in " ".join(run.stderr.replace("│", " ").split()), run.stderr
    assert not known.exists() and "LOSS" not in run.stdout


@pytest.fixture
def silent_host():
    """A TCP server on loopback that accepts connections and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_host_that_never_answers_ssh_is_named_without_a_traceback(sshd_cluster, silent_host, tmp_path):
    cfg = sshd_cluster.write_config("silent", {"wedged": "127.0.0.1"}, port=silent_host,
                                    extra="ConnectTimeout 2")
    (tmp_path / "hosts").write_text("wedged slots=1\n")
    for _ in range(3):  # the traceback came about half the time
        run = _dsrun("--hostfile", str(tmp_path / "hosts"), "--ssh_config", str(cfg),
                     "tests/multinode/scripts/allreduce_train.py")
        assert run.returncode != 0
        err = " ".join(run.stderr.replace("│", " ").split())
        assert f"no SSH banner from 127.0.0.1:{silent_host} within 2 s" in err, run.stderr
        assert "Traceback" not in run.stderr and "No existing session" not in run.stderr, run.stderr

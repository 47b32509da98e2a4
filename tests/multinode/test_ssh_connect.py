"""SSH connection phase against a real sshd on loopback: config, host keys, failures before any rank starts."""
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from dsrun.launcher.ssh import (HostKeyPolicy, SshConnectError, connect_all, load_ssh_config, resolve_target,
                                start_agents)
from tests.multinode.conftest import free_port, keygen

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _close(conns):
    for c in conns.values():
        c.close()


def test_config_resolution(sshd_cluster):
    cfg = load_ssh_config(sshd_cluster.ssh_config)
    t = resolve_target("node-b", cfg)
    assert (t.hostname, t.port, t.user) == ("127.0.0.2", sshd_cluster.port, sshd_cluster.user)
    assert t.identity_files == (str(sshd_cluster.client_key),) and t.identities_only
    assert resolve_target("alice@other:2200", cfg).port == 2200


def test_accept_new_then_strict_and_changed_key(sshd_cluster, tmp_path):
    known = tmp_path / "known_hosts"
    cfg_path = sshd_cluster.write_config("kh_config", known_hosts=known)
    cfg = load_ssh_config(cfg_path)
    with pytest.raises(SshConnectError, match="you have requested strict checking"):
        connect_all(["node-a"], cfg, HostKeyPolicy.STRICT)
    assert not known.exists()
    conns = connect_all(["node-a", "node-b"], cfg, HostKeyPolicy.ACCEPT_NEW)
    _close(conns)
    lines = known.read_text().splitlines()
    assert sorted(l.split()[0] for l in lines) == [f"[127.0.0.1]:{sshd_cluster.port}", f"[127.0.0.2]:{sshd_cluster.port}"]
    _close(connect_all(["node-a", "node-b"], cfg, HostKeyPolicy.STRICT))  # now known: strict passes
    # A changed key is refused under either policy, with the fix in the message.
    fake = keygen(tmp_path / "other_host_key").with_suffix(".pub").read_text().split()
    known.write_text("".join(f"{l.split()[0]} {fake[0]} {fake[1]}\n" for l in lines))
    with pytest.raises(SshConnectError) as e:
        connect_all(["node-a", "node-b"], cfg, HostKeyPolicy.ACCEPT_NEW)
    assert set(e.value.failures) == {"node-a", "node-b"}
    assert all("REMOTE HOST IDENTIFICATION HAS CHANGED" in why for why in e.value.failures.values())


def test_per_host_failure_table(sshd_cluster, tmp_path):
    wrong_key = keygen(tmp_path / "wrong_key")
    good = sshd_cluster.write_config("good", {"node-a": "127.0.0.1"})
    bad_key = sshd_cluster.write_config("badkey", {"node-b": "127.0.0.2"}, identity=wrong_key)
    refused = sshd_cluster.write_config("refused", {"node-c": "127.0.0.3"}, port=free_port("127.0.0.3"))
    combined = tmp_path / "combined"
    combined.write_text(good.read_text() + bad_key.read_text() + refused.read_text())
    with pytest.raises(SshConnectError) as e:
        connect_all(["node-a", "node-b", "node-c"], load_ssh_config(combined), HostKeyPolicy.ACCEPT_NEW)
    f = e.value.failures
    assert set(f) == {"node-b", "node-c"}, f
    assert "authentication failed" in f["node-b"] and str(wrong_key) in f["node-b"]
    assert "connection refused at 127.0.0.3" in f["node-c"]
    assert "no rank was started" in str(e.value) and "node-c (" in str(e.value)
    # Failed logins are closed at once: sshd keeps no half-open session around.
    deadline = time.monotonic() + 5
    while psutil.Process(sshd_cluster.proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.Process(sshd_cluster.proc.pid).children()


def test_proxy_jump(sshd_cluster):
    cfg_path = sshd_cluster.write_config("jump", {"node-a": "127.0.0.1"})
    via = sshd_cluster.write_config("jump_b", {"node-b": "127.0.0.2"}, extra="ProxyJump node-a")
    cfg_path.write_text(cfg_path.read_text() + via.read_text())
    conns = connect_all(["node-b"], load_ssh_config(cfg_path), HostKeyPolicy.ACCEPT_NEW)
    try:
        conn = conns["node-b"]
        assert len(conn.jumps) == 1 and conn.jumps[0].get_transport().is_active()
        assert conn.run("echo $SSH_CONNECTION", 10)[1].split()[2] == "127.0.0.2"
    finally:
        _close(conns)


def test_agent_bootstrap_checks_each_node(sshd_cluster, tmp_path):
    """One session per node checks the working directory, the agent's import, the master address and the port."""
    cfg = load_ssh_config(sshd_cluster.ssh_config)
    conns = connect_all(["node-a", "node-b"], cfg, HostKeyPolicy.ACCEPT_NEW)
    try:
        kw = dict(python=sys.executable, probe_port=sshd_cluster.port, port_candidates=[free_port()])
        with pytest.raises(SshConnectError, match="working directory") as e:
            start_agents(conns, cwd=str(tmp_path / "no_such_dir"), master_addr="127.0.0.1", **kw)
        assert set(e.value.failures) == {"node-a", "node-b"} and "no rank was started" in str(e.value)
        with pytest.raises(SshConnectError, match="cannot reach master address 127.0.0.9") as e:
            start_agents(conns, cwd=str(ROOT), master_addr="127.0.0.9", **kw)
        assert set(e.value.failures) == {"node-a", "node-b"}
        busy = socket.socket()
        busy.bind(("", free_port()))
        busy.listen()
        try:
            with pytest.raises(SshConnectError, match=r"none of the ports \[\d+\] is free") as e:
                start_agents(conns, cwd=str(ROOT), master_addr="127.0.0.1", python=sys.executable,
                             probe_port=sshd_cluster.port, port_candidates=[busy.getsockname()[1]])
            assert set(e.value.failures) == {"node-a"}  # only the master node looks for a port
        finally:
            busy.close()
        agents = start_agents(conns, cwd=str(ROOT), master_addr="127.0.0.1", **kw)
        assert agents["node-a"].port == kw["port_candidates"][0] and agents["node-b"].port is None
        for agent in agents.values():  # no job sent: closing the channel makes each agent exit
            agent.chan.close()
    finally:
        _close(conns)

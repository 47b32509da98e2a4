"""An OpenSSH server on loopback addresses, for the multi-node tests and benchmarks.

`loopback_sshd(dir)` starts Debian's sshd on a free port listening on
127.0.0.1 and 127.0.0.2 (both loopback on Linux; more addresses of this
machine may be added), with host and client keys generated in `dir`, and
writes an ssh config file that maps the host aliases `node-a` -> 127.0.0.1
and `node-b` -> 127.0.0.2. dsrun reads that file through `--ssh_config`.
The known_hosts file lists the server's key for every listen address.
Nothing outside this machine is contacted. Plain Python (no pytest), so
bench/ can start the same daemon; the `sshd_cluster` fixture in conftest.py
wraps it.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.system_packages import require_debian_packages

LOOPBACK_NODES = {"node-a": "127.0.0.1", "node-b": "127.0.0.2"}


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that was free on `addr` a moment ago (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def wait_for_port(addr: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    """Wait until `addr:port` accepts connections.

    Raises:
        RuntimeError: `proc` exited first, or nothing listened within
            `timeout` seconds; the message ends with the daemon's log.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{proc.args[0]} did not listen on {addr}:{port} within {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM `proc`, SIGKILL it after 10 s, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def keygen(path: Path) -> Path:
    """Write a passphrase-less ed25519 key pair at `path` and `path`.pub; return `path`."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


@dataclass
class SshCluster:
    """A running loopback sshd and the client-side files that reach it."""

    dir: Path
    port: int
    ssh_config: Path
    known_hosts: Path
    client_key: Path
    user: str
    log: Path
    proc: subprocess.Popen

    def write_config(self, name: str, hosts: dict[str, str] | None = None, *, port: int | None = None,
                     identity: Path | None = None, known_hosts: Path | None = None, extra: str = "") -> Path:
        """Write an ssh config `name` in the cluster dir and return its path.

        Args:
            hosts: alias -> address (default node-a -> 127.0.0.1, node-b -> 127.0.0.2).
            port, identity, known_hosts: override the working values.
            extra: lines added to every Host block (e.g. "ProxyJump node-a").
        """
        hosts = hosts or LOOPBACK_NODES
        blocks = []
        for alias, addr in hosts.items():
            blocks.append(
                f"Host {alias}\n    HostName {addr}\n    Port {port or self.port}\n    User {self.user}\n"
                f"    IdentityFile {identity or self.client_key}\n    IdentitiesOnly yes\n"
                f"    UserKnownHostsFile {known_hosts or self.known_hosts}\n" + "".join(f"    {x}\n" for x in extra.splitlines())
            )
        path = self.dir / name
        path.write_text("".join(blocks))
        return path

    def write_many_hosts(self, count: int, slots: int) -> tuple[Path, Path]:
        """An ssh config and a hostfile for `count` hosts `host-000`, `host-001`, ... of `slots` slots each.

        The aliases take turns over the listen addresses (127.0.0.1,
        127.0.0.2, ...): sshd listens on at most 16 addresses, so many
        hosts share each. Returns (ssh config path, hostfile path).
        """
        addresses = list(LOOPBACK_NODES.values())
        names = [f"host-{i:03d}" for i in range(count)]
        config = self.write_config(f"ssh_config_{count}",
                                   {n: addresses[i % len(addresses)] for i, n in enumerate(names)})
        hostfile = self.dir / f"hostfile_{count}"
        hostfile.write_text("".join(f"{n} slots={slots}\n" for n in names))
        return config, hostfile


@contextlib.contextmanager
def loopback_sshd(d: Path, extra_addresses: tuple[str, ...] = ()) -> Iterator[SshCluster]:
    """Run sshd for the duration of the `with` block; its files live in the existing directory `d`.

    Needs openssh-server/openssh-client (installed by `make test`, see tests/system_packages.py).

    Args:
        d: empty directory for keys, configs, pid file and log.
        extra_addresses: further addresses of this machine to listen on,
            besides 127.0.0.1 and 127.0.0.2 (e.g. a benchmark's veth address).

    Yields:
        The SshCluster, with `ssh_config` written for node-a and node-b.

    Raises:
        RuntimeError: sshd did not start listening (its log is in the message),
            or the packages are not installed.
    """
    require_debian_packages("openssh-server", "openssh-client")
    host_key = keygen(d / "ssh_host_ed25519_key")
    client_key = keygen(d / "id_client")
    (d / "authorized_keys").write_text((d / "id_client.pub").read_text())
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    port = free_port()
    user = pwd.getpwuid(os.getuid()).pw_name
    addresses = (*LOOPBACK_NODES.values(), *extra_addresses)
    listen = "".join(f"ListenAddress {a}\n" for a in addresses)
    sshd_cfg = d / "sshd_config"
    sshd_cfg.write_text(f"""\
Port {port}
{listen}HostKey {host_key}
PidFile {d}/sshd.pid
AuthorizedKeysFile {d}/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
AllowTcpForwarding yes
MaxStartups 200
MaxSessions 50
LogLevel VERBOSE
""")
    # The nodes' key is known, as a cluster's admin would list it: dsrun refuses unknown hosts by default.
    known_hosts = d / "known_hosts"
    host_pub = " ".join((d / "ssh_host_ed25519_key.pub").read_text().split()[:2])
    known_hosts.write_text("".join(f"[{a}]:{port} {host_pub}\n" for a in addresses))
    log = d / "sshd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([shutil.which("sshd") or "/usr/sbin/sshd", "-D", "-e", "-f", str(sshd_cfg)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        for addr in addresses:
            wait_for_port(addr, port, proc, log)
        cluster = SshCluster(d, port, d / "ssh_config", known_hosts, client_key, user, log, proc)
        cluster.write_config("ssh_config")
        yield cluster
    finally:
        stop(proc)

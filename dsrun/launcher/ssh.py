"""Reaching nodes over SSH with paramiko (no pdsh, no ssh binary).

`connect_all` opens one SSH connection per host, at most `parallelism`
(`--ssh_parallelism`, default 32) at a time, before any rank starts; if any
host cannot be resolved, reached, verified or authenticated, it raises
`SshConnectError` carrying a per-host table of what failed, and the job
never starts anywhere. `start_agents` then starts the node agent over each
connection, in the same working directory with the same Python as the head
unless overridden, and waits until every agent is ready for its job (see
[Note: one session per node]); only then does the head send the jobs.

[Note: one session per node]
Each SSH session costs the node a login shell (which may read a slow
~/.bashrc: bash does so for commands run by sshd) and each Python a start
and the agent's imports. So a node gets exactly one session and one Python
before its ranks: the agent's bootstrap (`agent_command`) checks that the
node reaches the master address (a TCP connection to the master's sshd
port), imports the agent (which proves the working directory, the Python
and dsrun), on the master node finds a free rendezvous port, prints
`DSRUN-AGENT-READY <port>`, and only then becomes the agent, which waits
for its job on stdin. If any node fails, the head closes every channel: the
waiting agents see EOF before a job and exit, and no rank starts anywhere.
Before, a node had three (a check, a reachability probe, the agent): at 16
nodes on one loaded 2-core machine the nodes' CPU went from 22 s to 9 s and
start-up from 26 s to 10 s (bench/launcher/README.md).

[Note: what crosses the SSH channel]
The remote command line is only `cd CWD && exec PYTHON -c BOOTSTRAP
MASTER_ADDR PORT [PORT...]` (see [Note: one session per node]). The job
description, including every propagated environment variable, is written
as one JSON line to the channel's stdin, so no value ever appears in a
command line (visible in `ps` on the node and in sshd logs) or in
dsrun's output. The channel's stdin stays open for the whole job: when the
head dies or the connection drops, sshd closes the agent's stdin, and the
agent kills its ranks on EOF. So no rank outlives its connection.

ssh config (default ~/.ssh/config, or `--ssh_config PATH`): HostName, User,
Port, IdentityFile, IdentitiesOnly, ConnectTimeout, UserKnownHostsFile,
GlobalKnownHostsFile, StrictHostKeyChecking, ProxyJump (one or more hops,
each resolved through the same config) and ProxyCommand are honoured.

[Note: host keys]
Host keys are checked as non-interactive OpenSSH checks them. A host's key
is looked up in every known-hosts file: UserKnownHostsFile (default
~/.ssh/known_hosts ~/.ssh/known_hosts2) and GlobalKnownHostsFile (default
/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2). A key that differs
from a listed one is refused whatever the policy ("REMOTE HOST
IDENTIFICATION HAS CHANGED"; OpenSSH with StrictHostKeyChecking=no would
connect with restrictions, dsrun never does, since it sends the job and its
propagated secrets). A host listed nowhere is refused (`strict`) unless the
policy is `accept-new`, which adds its key to the first UserKnownHostsFile
once every host of the job connected. The policy is `--ssh_host_key_policy`
when given, else the host's StrictHostKeyChecking (accept-new, no and off
mean accept-new; yes and ask mean strict: dsrun cannot ask), else strict,
which is what OpenSSH does without a terminal to ask on.
"""
from __future__ import annotations

import base64
import enum
import getpass
import hashlib
import logging
import os
import shlex
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import paramiko
from rich.table import Table

from dsrun.launcher.head import AgentHandle, Runner
from dsrun.launcher.job import NodeJob
from dsrun.launcher.placement import derived_port

AGENT_MODULE = "dsrun.launcher.agent"
DEFAULT_CONNECT_TIMEOUT = 10.0
# Connections opened, and agents started, at once (--ssh_parallelism): what one sshd's MaxStartups (default 10:30:100)
# and a 2-core head keep up with; more only queues handshakes.
DEFAULT_SSH_PARALLELISM = 32
# Seconds an agent gets to become ready (login shell, Python start, imports, probes) at the least.
AGENT_READY_TIMEOUT = 60.0
READY_MARKER = b"DSRUN-AGENT-READY"
# Exit status of an agent whose SSH connection dropped (what the ssh client reports for a lost link).
CONNECTION_LOST = 255
DEFAULT_USER_KNOWN_HOSTS = "~/.ssh/known_hosts ~/.ssh/known_hosts2"
DEFAULT_GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"

# paramiko's transport thread logs a traceback for every failed handshake (no handler configured, so
# logging's last resort prints it on stderr); dsrun reports each failure itself, once, in its table.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class HostKeyPolicy(str, enum.Enum):
    """What to do with a host whose key is in no known-hosts file (see [Note: host keys])."""

    STRICT = "strict"
    ACCEPT_NEW = "accept-new"

    @classmethod
    def for_target(cls, given: "HostKeyPolicy | None", target: "SshTarget") -> "HostKeyPolicy":
        """`given` (--ssh_host_key_policy) if set, else the host's StrictHostKeyChecking, else strict."""
        if given is not None:
            return given
        return cls.ACCEPT_NEW if target.strict_host_key_checking in ("accept-new", "no", "off") else cls.STRICT


@dataclass(frozen=True)
class SshTarget:
    """Where and how to reach one host, after applying the ssh config.

    Attributes:
        alias: the name as written in the hostfile.
        hostname: the address or name actually connected to (HostName).
        port: TCP port (Port, default 22).
        user: login name (User, default the local user).
        identity_files: private keys to offer (IdentityFile).
        identities_only: offer only `identity_files` (no agent, no ~/.ssh/id_*).
        known_hosts: where accepted new keys are written (the first UserKnownHostsFile).
        user_known_hosts / global_known_hosts: every file a key is looked up
            in (UserKnownHostsFile, GlobalKnownHostsFile).
        strict_host_key_checking: StrictHostKeyChecking, lower case, or None if unset.
        proxy_jump: jump hosts, outermost first (ProxyJump).
        proxy_command: command whose stdio carries the connection (ProxyCommand).
        timeout: connect timeout in seconds (ConnectTimeout).
    """

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    identities_only: bool
    known_hosts: Path
    user_known_hosts: tuple[Path, ...] = ()
    global_known_hosts: tuple[Path, ...] = ()
    strict_host_key_checking: str | None = None
    proxy_jump: tuple[str, ...] = ()
    proxy_command: str | None = None
    timeout: float = DEFAULT_CONNECT_TIMEOUT

    @property
    def known_hosts_files(self) -> tuple[Path, ...]:
        """Every known-hosts file of this host, user files first."""
        return (*self.user_known_hosts, *self.global_known_hosts)


def load_ssh_config(path: str | Path | None) -> paramiko.SSHConfig:
    """Read an ssh config file; `path=None` means ~/.ssh/config if it exists.

    Raises:
        FileNotFoundError: `path` was given explicitly and does not exist.
    """
    if path is None:
        default = Path.home() / ".ssh" / "config"
        return paramiko.SSHConfig.from_path(str(default)) if default.is_file() else paramiko.SSHConfig()
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"ssh config {str(p)!r} (given with --ssh_config) does not exist")
    return paramiko.SSHConfig.from_path(str(p))


def resolve_target(host: str, config: paramiko.SSHConfig) -> SshTarget:
    """Apply the ssh config to `host` (which may be `user@host:port`, as in ProxyJump)."""
    user, _, rest = host.rpartition("@")
    name, _, port = rest.partition(":")
    entry = config.lookup(name)
    user_files = _known_hosts_files(entry.get("userknownhostsfile", DEFAULT_USER_KNOWN_HOSTS))
    jumps = entry.get("proxyjump")
    return SshTarget(
        alias=host,
        hostname=entry.get("hostname", name),
        port=int(port or entry.get("port", 22)),
        user=user or entry.get("user") or getpass.getuser(),
        identity_files=tuple(os.path.expanduser(f) for f in entry.get("identityfile", [])),
        identities_only=entry.get("identitiesonly", "no").lower() == "yes",
        known_hosts=user_files[0] if user_files else Path(os.devnull),
        user_known_hosts=user_files,
        global_known_hosts=_known_hosts_files(entry.get("globalknownhostsfile", DEFAULT_GLOBAL_KNOWN_HOSTS)),
        strict_host_key_checking=entry["stricthostkeychecking"].lower() if "stricthostkeychecking" in entry else None,
        proxy_jump=tuple(j.strip() for j in jumps.split(",")) if jumps and jumps.lower() != "none" else (),
        proxy_command=entry.get("proxycommand") if entry.get("proxycommand", "none").lower() != "none" else None,
        timeout=float(entry.get("connecttimeout", DEFAULT_CONNECT_TIMEOUT)),
    )


def _known_hosts_files(value: str | list[str]) -> tuple[Path, ...]:
    """The paths of a UserKnownHostsFile/GlobalKnownHostsFile value ("none" means no file)."""
    words = value if isinstance(value, list) else value.split()
    return tuple(Path(os.path.expanduser(w)) for w in words if w.lower() != "none")


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint of a public key (as `ssh-keygen -l` prints it)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def _key_kind(key: paramiko.PKey) -> str:
    """OpenSSH's short name of a key type: ssh-ed25519 -> ED25519, ecdsa-sha2-nistp256 -> ECDSA."""
    name = key.get_name()
    return "ECDSA" if name.startswith("ecdsa") else name.removeprefix("ssh-").split("-")[0].upper()


class _RecordNewKeys(paramiko.MissingHostKeyPolicy):
    """accept-new: accept an unknown host and remember its key for known_hosts."""

    def __init__(self, sink: list[tuple[Path, str, paramiko.PKey]], known_hosts: Path, lock: threading.Lock):
        self._sink, self._known_hosts, self._lock = sink, known_hosts, lock

    def missing_host_key(self, client, hostname, key):
        with self._lock:
            self._sink.append((self._known_hosts, hostname, key))


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    def __init__(self, target: SshTarget) -> None:
        self._target = target

    def missing_host_key(self, client, hostname, key):
        t = self._target
        files = ", ".join(str(f) for f in t.known_hosts_files) or "none"
        keyscan = f"ssh-keyscan{f' -p {t.port}' if t.port != 22 else ''} {t.hostname} >> {t.known_hosts}"
        raise paramiko.SSHException(
            f"No {_key_kind(key)} host key is known for {hostname} and you have requested strict checking. "
            f"Host key verification failed. (known-hosts files: {files}.) Check that {fingerprint(key)} is the "
            f"host's key and add it ({keyscan}), or pass --ssh_host_key_policy accept-new, or set "
            f"StrictHostKeyChecking accept-new for the host in the ssh config")


class NoBannerError(paramiko.SSHException):
    """The TCP connection opened but the server sent no SSH banner in time."""


@dataclass
class _Connector:
    config: paramiko.SSHConfig
    policy: HostKeyPolicy | None  # None: each host's StrictHostKeyChecking decides
    new_keys: list[tuple[Path, str, paramiko.PKey]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def connect(self, target: SshTarget, depth: int = 0) -> tuple[paramiko.SSHClient, list[paramiko.SSHClient]]:
        """Connect to `target` through its jump hosts.

        Returns the target's client and the jump hosts' clients, which must
        stay open as long as the target's connection is used.
        """
        if depth > 8:
            raise paramiko.SSHException("ProxyJump chain deeper than 8 hops; is there a loop in the ssh config?")
        jumps: list[paramiko.SSHClient] = []
        try:
            for hop in target.proxy_jump:
                hop_target = resolve_target(hop, self.config)
                if not jumps:  # the first hop is reached the way its own config says
                    client, outer = self.connect(hop_target, depth + 1)
                    jumps += outer
                else:  # later hops are reached through the previous one
                    client = self._connect_one(hop_target, _tunnel(jumps[-1], hop_target))
                jumps.append(client)
            if jumps:
                sock = _tunnel(jumps[-1], target)
            elif target.proxy_command:
                sock = paramiko.ProxyCommand(target.proxy_command)
            else:
                sock = None
            return self._connect_one(target, sock), jumps
        except BaseException:
            for jump in reversed(jumps):
                jump.close()
            raise

    def _connect_one(self, target: SshTarget, sock) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        for path in target.known_hosts_files:  # see [Note: host keys]
            if path.is_file():
                try:
                    client.load_system_host_keys(str(path))  # "system": paramiko never rewrites these
                except OSError:
                    continue  # unreadable, as OpenSSH skips it
        if HostKeyPolicy.for_target(self.policy, target) is HostKeyPolicy.STRICT:
            client.set_missing_host_key_policy(_RefuseUnknown(target))
        else:
            client.set_missing_host_key_policy(_RecordNewKeys(self.new_keys, target.known_hosts, self.lock))
        try:
            client.connect(
                target.hostname, port=target.port, username=target.user,
                key_filename=list(target.identity_files) or None,
                look_for_keys=not target.identities_only, allow_agent=not target.identities_only,
                timeout=target.timeout, banner_timeout=target.timeout, auth_timeout=target.timeout,
                sock=sock,
            )
        except BaseException as exc:
            # A refused key or login leaves paramiko's transport open; close it, or
            # the server keeps a half-open session until its LoginGraceTime.
            transport = client.get_transport()
            no_banner = transport is not None and not transport.remote_version
            client.close()
            if no_banner and isinstance(exc, (paramiko.SSHException, EOFError, OSError)):
                raise NoBannerError(f"no SSH banner from {target.hostname}:{target.port} within "
                                    f"{target.timeout:g} s: something accepts TCP there but does not speak "
                                    "SSH (a wedged sshd, or another service on that port?)") from None
            raise
        client.get_transport().set_keepalive(15)  # notice a dead link while the job runs
        return client

    def save_new_keys(self) -> None:
        """Append the keys accepted under accept-new to their known_hosts files."""
        for path, hostname, key in self.new_keys:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def _tunnel(via: paramiko.SSHClient, target: SshTarget) -> paramiko.Channel:
    """A direct-tcpip channel from jump host `via` to the target (what `ssh -J` does)."""
    return via.get_transport().open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0))


@dataclass
class Connection:
    """An open SSH connection to one node (plus the jump hosts it goes through)."""

    target: SshTarget
    client: paramiko.SSHClient
    jumps: list[paramiko.SSHClient]

    def run(self, command: str, timeout: float) -> tuple[int, str]:
        """Run a short command on the node; returns (exit status, stdout+stderr text)."""
        chan = self.client.get_transport().open_session(timeout=timeout)
        chan.settimeout(timeout)
        chan.set_combine_stderr(True)
        chan.exec_command(command)
        out = b""
        try:
            while chunk := chan.recv(65536):
                out += chunk
            status = chan.recv_exit_status()
        except socket.timeout:
            status, out = 124, out + f"\n(no answer within {timeout}s)".encode()
        finally:
            chan.close()
        return status, out.decode(errors="replace").strip()

    def close(self) -> None:
        self.client.close()
        for jump in reversed(self.jumps):
            jump.close()


class SshConnectError(RuntimeError):
    """One or more hosts could not be used; nothing was started anywhere.

    Attributes:
        failures: host alias -> what went wrong and how to fix it.
        targets: host alias -> the resolved target (address, port, user).
    """

    def __init__(self, failures: dict[str, str], targets: dict[str, SshTarget], stage: str):
        self.failures, self.targets, self.stage = failures, targets, stage
        lines = [f"  {h} ({_where(targets[h])}): {why}" for h, why in failures.items()]
        super().__init__(f"{stage} failed on {len(failures)} host(s); no rank was started:\n" + "\n".join(lines))

    def table(self) -> Table:
        """The failures as a rich table (host, address, reason)."""
        table = Table(title=f"dsrun: {self.stage} failed; no rank was started")
        for col in ("host", "address", "problem"):
            table.add_column(col, overflow="fold")
        for host, why in self.failures.items():
            table.add_row(host, _where(self.targets[host]), why)
        return table


def _where(t: SshTarget) -> str:
    via = f" via {','.join(t.proxy_jump)}" if t.proxy_jump else ""
    return f"{t.user}@{t.hostname}:{t.port}{via}"


def explain_connect_error(exc: BaseException, target: SshTarget) -> str:
    """A one-line reason for a failed connection, with the likely fix."""
    addr = f"{target.hostname}:{target.port}"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve host name {target.hostname!r} ({exc.strerror}); check the hostfile or HostName in the ssh config"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError) or isinstance(exc, ConnectionRefusedError):
        return f"connection refused at {addr}; is sshd running there, and is Port right in the ssh config?"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer from {addr} within {target.timeout:g}s (host down or firewalled?)"
    if isinstance(exc, paramiko.BadHostKeyException):
        name = target.hostname if target.port == 22 else f"[{target.hostname}]:{target.port}"  # as known_hosts has it
        listed = next((f for f in target.known_hosts_files if _lists(f, name)), target.known_hosts)
        return (f"WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! The {_key_kind(exc.key)} key of "
                f"{name} is {fingerprint(exc.key)}, not the one in {listed}: someone could be "
                "eavesdropping on you right now (man-in-the-middle attack), or the host key was just changed. "
                f"Host key verification failed. If the host was reinstalled, remove the old entry "
                f"(ssh-keygen -R '{name}' -f {listed}); otherwise do not connect")
    if isinstance(exc, paramiko.AuthenticationException):
        keys = ", ".join(target.identity_files) or "ssh-agent and ~/.ssh/id_*"
        return f"authentication failed for user {target.user!r} (keys offered: {keys}); check IdentityFile/User"
    if isinstance(exc, paramiko.SSHException):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _lists(path: Path, hostname: str) -> bool:
    """True if the known-hosts file at `path` has an entry for `hostname`."""
    try:
        return path.is_file() and paramiko.HostKeys(str(path)).lookup(hostname) is not None
    except (OSError, paramiko.SSHException):
        return False


def _check_parallelism(parallelism: int) -> None:
    if parallelism < 1:
        raise ValueError(f"--ssh_parallelism {parallelism}: give the number of hosts to connect to at once, 1 or more "
                         f"(default {DEFAULT_SSH_PARALLELISM})")


def connect_all(hosts: list[str], config: paramiko.SSHConfig, policy: HostKeyPolicy | None,
                parallelism: int = DEFAULT_SSH_PARALLELISM) -> dict[str, Connection]:
    """Connect to every host, at most `parallelism` handshakes at a time.

    Args:
        hosts: host aliases (hostfile names), in node order.
        config: the ssh config to resolve them with.
        policy: host key policy for unknown hosts, or None to follow each
            host's StrictHostKeyChecking (see [Note: host keys]).
        parallelism: connections in flight at once (--ssh_parallelism).

    Returns:
        alias -> open Connection, in `hosts` order. New host keys are written
        to known_hosts only when every host succeeded.

    Raises:
        ValueError: `parallelism` < 1.
        SshConnectError: with the reason for every host that failed; all
            connections that did open are closed again.
    """
    _check_parallelism(parallelism)
    targets = {h: resolve_target(h, config) for h in hosts}
    connector = _Connector(config, policy)

    def one(host: str) -> Connection | str:
        target = targets[host]
        try:
            client, jumps = connector.connect(target)
        except Exception as exc:  # every failure becomes a row of the table
            return explain_connect_error(exc, target)
        return Connection(target, client, jumps)

    with ThreadPoolExecutor(max_workers=min(parallelism, len(hosts))) as pool:
        results = dict(zip(hosts, pool.map(one, hosts)))
    failures = {h: r for h, r in results.items() if isinstance(r, str)}
    if failures:
        for r in results.values():
            if isinstance(r, Connection):
                r.close()
        raise SshConnectError(failures, targets, "connecting over SSH")
    connector.save_new_keys()
    return results  # type: ignore[return-value]


# The agent's bootstrap (see [Note: one session per node]). argv: master address, a port listening there, then the
# rendezvous ports to try (master node only). Exit 3: master unreachable; 4: no port free; 1: the import failed.
_AGENT_BOOTSTRAP = """\
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), 5).close()
except OSError as exc:
    print(exc.strerror or exc, file=sys.stderr)
    sys.exit(3)
from dsrun.launcher.agent import main
port = "-"
for candidate in sys.argv[3:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", int(candidate)))
    except OSError:
        continue
    finally:
        s.close()
    port = candidate
    break
if sys.argv[3:] and port == "-":
    sys.exit(4)
print("DSRUN-AGENT-READY", port, flush=True)
sys.exit(main())
"""
_UNREACHABLE, _NO_PORT = 3, 4


def agent_command(python: str, cwd: str, master_addr: str, probe_port: int, port_candidates: list[int]) -> str:
    """The remote command line: the agent's bootstrap; no job data, no environment values.

    See [Note: what crosses the SSH channel] and [Note: one session per node].
    `port_candidates` is empty on every node but the master.
    """
    args = " ".join(shlex.quote(str(a)) for a in (master_addr, probe_port, *port_candidates))
    return f"cd {shlex.quote(cwd)} && exec {shlex.quote(python)} -c {shlex.quote(_AGENT_BOOTSTRAP)} {args}"


@dataclass
class WaitingAgent:
    """An agent that passed its bootstrap and waits for its job on the channel's stdin."""

    chan: paramiko.Channel
    stdout: BinaryIO
    stderr: BinaryIO
    port: int | None  # the free rendezvous port it found (master node), else None


def _start_one(conn: Connection, command: str, timeout: float) -> WaitingAgent | tuple[int | None, str]:
    """Start the bootstrap on `conn` and wait for its ready line; (exit status or None, output) if it never came."""
    chan = conn.client.get_transport().open_session(timeout=timeout)
    chan.settimeout(timeout)
    chan.exec_command(command)
    stdout, stderr = chan.makefile("rb"), chan.makefile_stderr("rb")
    before: list[bytes] = []  # what the login shell printed (a chatty ~/.bashrc), kept for the reason only
    try:
        while line := stdout.readline():
            if line.startswith(READY_MARKER):
                chan.settimeout(None)  # from now on the head's pumps block on it
                word = line.split()[-1].decode()
                return WaitingAgent(chan, stdout, stderr, int(word) if word.isdigit() else None)
            before.append(line)
        status: int | None = chan.recv_exit_status()
        out = b"".join(before) + stderr.read()
    except socket.timeout:
        status, out = None, b"".join(before)
    chan.close()
    return status, out.decode(errors="replace").strip()


def start_agents(conns: dict[str, Connection], *, python: str, cwd: str, master_addr: str, probe_port: int,
                 port_candidates: list[int], parallelism: int = DEFAULT_SSH_PARALLELISM) -> dict[str, WaitingAgent]:
    """Start every node's agent through its bootstrap, at most `parallelism` at a time; wait until all are ready.

    The first host of `conns` is the master node: only its bootstrap looks
    for a free port among `port_candidates`. Every bootstrap opens a TCP
    connection to `master_addr:probe_port` (a port known to listen there,
    the master's sshd), so a failure means the address is wrong as seen
    from that node.

    Returns:
        alias -> WaitingAgent, in `conns` order; the master's `port` is set.

    Raises:
        ValueError: `parallelism` < 1.
        SshConnectError: the reason for every node whose agent did not get
            ready; every channel is closed, so the agents that were ready
            exit without a job and no rank starts anywhere.
    """
    _check_parallelism(parallelism)
    hosts = list(conns)

    def one(host: str) -> WaitingAgent | str:
        conn = conns[host]
        candidates = port_candidates if host == hosts[0] else []
        timeout = max(conn.target.timeout, AGENT_READY_TIMEOUT)
        try:
            result = _start_one(conn, agent_command(python, cwd, master_addr, probe_port, candidates), timeout)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            return f"could not open a session for the agent: {explain_connect_error(exc, conn.target)}"
        if isinstance(result, WaitingAgent):
            return result
        status, out = result
        last = out.splitlines()[-1] if out else "no output"
        if status == _UNREACHABLE:
            return (f"cannot reach master address {master_addr} (tried TCP port {probe_port}): {last}; "
                    "pass --master_addr with an address all nodes can reach")
        if status == _NO_PORT:
            return f"none of the ports {candidates} is free"
        if status is None:
            return (f"the agent was not ready within {timeout:g} s (the node overloaded, or its login shell "
                    f"slow to start?): {out[-300:] or 'no output'}")
        return (f"cannot run {python} -m {AGENT_MODULE} in {cwd} (working directory, Python or dsrun missing on "
                f"that node?) (exit {status}: {out[-300:] or 'no output'})")

    with ThreadPoolExecutor(max_workers=min(parallelism, len(hosts))) as pool:
        results = dict(zip(hosts, pool.map(one, hosts)))
    failures = {h: r for h, r in results.items() if isinstance(r, str)}
    if failures:
        for r in results.values():
            if isinstance(r, WaitingAgent):
                r.chan.close()
        raise SshConnectError(failures, {h: c.target for h, c in conns.items()}, "starting the node agents")
    return results  # type: ignore[return-value]


class SshAgentHandle(AgentHandle):
    """An agent running on a node through one SSH session channel."""

    def __init__(self, job: NodeJob, agent: WaitingAgent) -> None:
        super().__init__(job)
        self._chan = agent.chan
        self._stdout = agent.stdout  # the same buffered files that read the ready line: nothing read is lost
        self._stderr = agent.stderr
        self._killed = False

    @property
    def stdout(self) -> BinaryIO:
        return self._stdout

    @property
    def stderr(self) -> BinaryIO:
        return self._stderr

    def poll(self) -> int | None:
        if self._chan.exit_status_ready():
            return self._chan.recv_exit_status()
        if self._killed:
            return 128 + signal.SIGKILL
        transport = self._chan.get_transport()
        if transport is None or not transport.is_active():
            return CONNECTION_LOST  # the link dropped: sshd closed the agent's stdin, it kills its ranks
        return None

    def send(self, data: bytes) -> None:
        try:
            self._chan.sendall(data)
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the channel is gone; the agent saw EOF and is tearing down

    def kill(self) -> None:
        # Closing the channel closes the agent's stdin on the node: it kills its ranks on EOF.
        self._killed = True
        self._chan.close()


class SshRunner(Runner):
    """Hands each node's waiting agent its job (see `start_agents`); closing it ends every connection."""

    def __init__(self, conns: dict[str, Connection], agents: dict[str, WaitingAgent]) -> None:
        self.conns = conns
        self.agents = agents

    def start(self, job: NodeJob) -> SshAgentHandle:
        agent = self.agents[job.host]
        # The job, environment included, goes on stdin, never on the command line.
        agent.chan.sendall(job.to_json_line().encode())
        return SshAgentHandle(job, agent)

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()


def job_port_candidates(job_id: str, preferred: int | None, count: int = 8) -> list[int]:
    """Ports to try for the rendezvous, best first: `preferred` (--master_port) if given, then ports derived from the job id.

    Without --master_port the derived ports come first, not 29500: jobs
    started at the same time on one master then do not race for the same
    well-known port between the check and rank 0's bind (DeepSpeed #3916,
    #1656). See `placement.derived_port`.
    """
    derived = [derived_port(job_id, i) for i in range(count)]
    return [preferred, *derived] if preferred else derived


@dataclass
class SshLaunch:
    """A checked SSH launch: open connections, the rendezvous address and port."""

    runner: SshRunner
    master_addr: str
    master_port: int
    notes: list[str]


def prepare_ssh_launch(hosts: list[str], *, ssh_config: str | Path | None, policy: HostKeyPolicy | None, python: str,
                       cwd: str, job_id: str, master_addr: str | None, master_port: int | None,
                       parallelism: int = DEFAULT_SSH_PARALLELISM) -> SshLaunch:
    """Connect to every host, start every node's agent, and settle the rendezvous.

    master_addr: as given, or the first host's address as the head reaches it
    (HostName from the ssh config); either way every node must be able to
    open a TCP connection to it (checked against the master's sshd port).
    master_port: checked free on the master node; if taken, the first free
    port derived from the job id is used and a note says so. Without it, the
    first free port derived from the job id (see `job_port_candidates`).
    parallelism: connections and agent starts in flight at once (--ssh_parallelism).

    Raises:
        ValueError: `parallelism` < 1.
        SshConnectError: per-host reasons; no connection is left open, no rank started.
        FileNotFoundError: `ssh_config` given but missing.
    """
    _check_parallelism(parallelism)
    config = load_ssh_config(ssh_config)
    conns = connect_all(hosts, config, policy, parallelism)
    try:
        master = conns[hosts[0]]
        addr = master_addr or master.target.hostname
        candidates = job_port_candidates(job_id, master_port)
        agents = start_agents(conns, python=python, cwd=cwd, master_addr=addr, probe_port=master.target.port,
                              port_candidates=candidates, parallelism=parallelism)
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise
    port = agents[hosts[0]].port
    notes = [f"port {master_port} is busy on {hosts[0]}; using {port}"] if master_port and port != master_port else []
    return SshLaunch(SshRunner(conns, agents), addr, port, notes)

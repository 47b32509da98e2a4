"""Two "nodes" on one machine joined by a real, rate-limitable link.

[Note: why node-b lives in a network namespace]
Over loopback SSH both nodes share one network stack: gloo binds each rank
to the address this machine's hostname resolves to (127.0.0.1 here), and
even a rank bound to 127.0.0.2 would not separate the traffic, because gloo
connects without binding its outgoing sockets and Linux picks 127.0.0.1 as
the source of every connection to a 127.x address (gloo's
transport/tcp/helpers.h, ConnectOperation::run). So a `tc` filter on `lo`
cannot tell node-to-node bytes from bytes inside a node, and a rate limit
there slows both.

Instead node-b's processes run in a network namespace of their own,
joined to this one by a veth pair in the benchmarking range of RFC 2544
(198.18.N.1 here, 198.18.N.2 in the namespace, N the link's index; no
existing interface or address is changed). Each node's ranks bind gloo to their end of the pair
(GLOO_SOCKET_IFNAME), so:
- ranks of node-a talk to each other through this machine's `lo`, ranks of
  node-b through the namespace's own `lo`;
- every byte between the nodes crosses the veth pair, where the interface
  counters measure it (TCP/IP headers and ACKs included) and a `tbf`
  qdisc on both ends limits its rate in each direction.
Shared memory is not network-namespaced; dsrun's shm transport still stays
off between the nodes because each rank's LOCAL_WORLD_SIZE (2) is not the
WORLD_SIZE (see dsrun/runtime/comm/collectives.py [Note: choosing the
transport]).

SSH stays on loopback: the head reaches node-a at 127.0.0.1 and node-b at
127.0.0.2 (tests/multinode/sshd.py); `python_wrapper` writes the script
given to dsrun as `--remote_python`, which sends a process whose SSH session
arrived at 127.0.0.2 into the namespace. The rendezvous address is node-a's
end of the pair, reachable from both nodes.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.system_packages import require_debian_packages

PREFIX = 30
MAX_LINKS = 64  # several benchmarks or tests may hold a link at once, each its own names and /30


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def _tc(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [*(["ip", "netns", "exec", netns] if netns else []), "tc", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


@dataclass
class NodeLink:
    """The link between node-a (this namespace) and node-b (namespace `netns`).

    Attributes:
        index: which of the MAX_LINKS sets of names and addresses this link uses.
        netns: node-b's network namespace.
        iface_a, iface_b: the veth ends (node-a's here, node-b's in `netns`).
        addr_a, addr_b: their addresses, 198.18.index.1 and .2 (RFC 2544's range).
        rate: the current limit per direction (tc syntax), None for none.
    """

    index: int
    rate: str | None = None

    @property
    def netns(self) -> str:
        return f"dsrun-nb{self.index}"

    @property
    def iface_a(self) -> str:
        return f"dsrun-va{self.index}"

    @property
    def iface_b(self) -> str:
        return f"dsrun-vb{self.index}"

    @property
    def addr_a(self) -> str:
        return f"198.18.{self.index}.1"

    @property
    def addr_b(self) -> str:
        return f"198.18.{self.index}.2"

    def set_rate(self, rate: str | None) -> None:
        """Limit each direction to `rate` (tc syntax, e.g. "200mbit"), or lift the limit (None).

        A token bucket (tbf) on the sending end of each direction; burst
        64 KiB, at most 200 ms of queue before packets are dropped (TCP then
        backs off, as on a congested link).

        Raises:
            subprocess.CalledProcessError: tc refused the rate (its stderr says why).
        """
        for netns, iface in ((None, self.iface_a), (self.netns, self.iface_b)):
            _tc("qdisc", "del", "dev", iface, "root", netns=netns, check=False)
            if rate is not None:
                _tc("qdisc", "add", "dev", iface, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "200ms",
                    netns=netns)
        self.rate = rate

    def bytes(self) -> int:
        """Bytes that crossed the link so far, both directions (node-a's end: sent + received)."""
        stats = Path("/sys/class/net") / self.iface_a / "statistics"
        return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())

    def _remove(self) -> None:
        """Delete the pair and the namespace (the qdiscs go with the interfaces)."""
        _ip("link", "del", self.iface_a, check=False)
        _ip("netns", "del", self.netns, check=False)


def _unused_index() -> int:
    namespaces = _ip("netns", "list").stdout.split()
    addresses = _ip("-o", "-4", "addr", "show").stdout
    for index in range(MAX_LINKS):
        link = NodeLink(index)
        if (link.netns not in namespaces and not Path(f"/sys/class/net/{link.iface_a}").exists()
                and f" 198.18.{index}." not in addresses):
            return index
    raise RuntimeError(f"all {MAX_LINKS} link names are taken (dsrun-nb0 ... ); a run killed by SIGKILL leaves "
                       "its own: remove it with `ip netns del dsrun-nbN; ip link del dsrun-vaN`")


@contextlib.contextmanager
def node_link(rate: str | None = None) -> Iterator[NodeLink]:
    """Create a namespace and a veth pair for the `with` block; remove both afterwards, also on error.

    Needs root and iproute2 (installed by `make test`). Takes the first set of
    names no other link holds, so several can exist at once.

    Raises:
        RuntimeError: not root, or every set of names is taken.
        subprocess.CalledProcessError: an `ip` command failed (its stderr says why).
    """
    if shutil.which("ip") is None or shutil.which("tc") is None:
        require_debian_packages("iproute2")
    if os.geteuid() != 0:
        raise RuntimeError("a network namespace and a veth pair need root; run as root")
    link = NodeLink(_unused_index())
    try:
        _ip("netns", "add", link.netns)
        _ip("link", "add", link.iface_a, "type", "veth", "peer", "name", link.iface_b)
        _ip("link", "set", link.iface_b, "netns", link.netns)
        _ip("addr", "add", f"{link.addr_a}/{PREFIX}", "dev", link.iface_a)
        _ip("link", "set", link.iface_a, "up")
        _ip("addr", "add", f"{link.addr_b}/{PREFIX}", "dev", link.iface_b, netns=link.netns)
        _ip("link", "set", link.iface_b, "up", netns=link.netns)
        _ip("link", "set", "lo", "up", netns=link.netns)
        link.set_rate(rate)
        yield link
    finally:
        link._remove()


def python_wrapper(path: Path, python: str, link: NodeLink) -> Path:
    """Write an executable script at `path` that runs `python` on the node its SSH session reached.

    Sessions that arrived at node-b's address (127.0.0.2, from
    SSH_CONNECTION) run `python` inside `link`'s namespace with gloo bound
    to node-b's end of the pair; any other process runs it here, bound to
    node-a's end. Give the path to dsrun as `--remote_python`: the agents
    and the ranks both start through it.
    """
    py = shlex.quote(python)
    path.write_text(f"""#!/bin/sh
# dsrun --remote_python for two nodes on one machine (tests/multinode/netns_link.py)
case " $SSH_CONNECTION " in
  *" 127.0.0.2 "*) GLOO_SOCKET_IFNAME={link.iface_b} exec ip netns exec {link.netns} {py} "$@" ;;
  *) GLOO_SOCKET_IFNAME={link.iface_a} exec {py} "$@" ;;
esac
""")
    path.chmod(0o755)
    return path

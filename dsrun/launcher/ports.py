"""Choosing the rendezvous port (MASTER_PORT).

[Note: port check]
Rank 0's TCP store listens on MASTER_PORT on every interface, so a port is
"free" if this host can bind it on the IPv4 wildcard address (and the IPv6
one, where the host has IPv6). SO_REUSEADDR is set as the store sets it, so
a port left in TIME_WAIT by an earlier job counts as free. The check can
only be made on the master's own host; for a remote master the port is
used as given. Between the check and rank 0's bind another process could
take the port (a race no launcher can close without passing the socket
itself); the job then fails at rendezvous with an "address in use" error.
So a one-node launch without --master_port does not start from one
well-known port (29500, DeepSpeed's and torchrun's default): two jobs
started together on one machine would both find it free and race for it.
It tries ports derived from its job id instead, as an SSH launch does
(`placement.derived_port`), which two jobs share only by chance.
"""
from __future__ import annotations

import ipaddress
import socket

import psutil

DEFAULT_MASTER_PORT = 29500


class PortError(ValueError):
    """The port asked for with --master_port cannot be used."""


def _can_bind(family: int, host: str, port: int) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
            return True
    except OSError:
        return False


def port_is_free(port: int) -> bool:
    """True if a TCP server could listen on `port` on all interfaces of this host (see [Note: port check])."""
    if not _can_bind(socket.AF_INET, "", port):
        return False
    return not socket.has_ipv6 or not _ipv6_available() or _can_bind(socket.AF_INET6, "::", port)


def _ipv6_available() -> bool:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
        return True
    except OSError:
        return False


def free_port() -> int:
    """A port the kernel reports free right now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def is_local_address(addr: str) -> bool:
    """True if `addr` (a name or an IP) resolves to a loopback address or an address of this host."""
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(addr, None)}
    except socket.gaierror:
        return False
    own = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(ipaddress.ip_address(ip.split("%")[0]).is_loopback or ip in own for ip in resolved)


def choose_master_port(master_addr: str, requested: int | None, job_id: str,
                       candidates: int = 8) -> tuple[int, str | None]:
    """The port for the rendezvous and a one-line notice if dsrun had to fall back.

    With no `requested` port: the first free one of `candidates` ports
    derived from `job_id` (see [Note: port check]), else a free port from
    the kernel (with a notice saying so). With a `requested` port that is
    busy on this host: PortError naming the port and how to fix it. A master
    on another host is not checked.
    """
    if not is_local_address(master_addr):
        return requested or DEFAULT_MASTER_PORT, None
    if requested is not None:
        if not port_is_free(requested):
            raise PortError(
                f"--master_port {requested} is already in use on this host (another job or server listens "
                "on it); pass a free port, or leave --master_port out and dsrun picks one"
            )
        return requested, None
    from dsrun.launcher.placement import derived_port  # here: ranks import this module, not rich
    for index in range(candidates):
        if port_is_free(port := derived_port(job_id, index)):
            return port, None
    port = free_port()
    return port, (
        f"the {candidates} ports derived from job {job_id} are in use; using MASTER_PORT={port} instead "
        "(pass --master_port to choose)"
    )

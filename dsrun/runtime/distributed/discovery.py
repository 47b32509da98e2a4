"""Rank 0's address for ranks that mpirun/mpiexec started without MASTER_ADDR.

[Note: master address under mpirun]
Kubeflow's MPI runtime (Trainer v2's DeepSpeed runtime, the MPI Operator)
starts a job as plain `mpirun python train.py`: every rank gets its rank and
the world size from the MPI launcher (OMPI_COMM_WORLD_*, PMI_*, see
dsrun/launcher/mpi.py) but nobody sets MASTER_ADDR. The ranks need rank 0's
host for the TCP rendezvous; it is found, in this order:

1. mpi4py, when installed: rank 0 broadcasts
   its address over MPI_COMM_WORLD, as DeepSpeed's `mpi_discovery` does.
   Every rank gets the same answer and nothing is guessed.
2. The hostfile the MPI launcher read (Open MPI's
   OMPI_MCA_orte_default_hostfile, which the MPI Operator sets; Hydra's
   HYDRA_HOST_FILE): its first host. mpirun maps ranks by slot and by node
   alike starting at the first host, so rank 0 runs there; rank 0 checks
   that the host is its own machine and fails with both names if not (a
   `--host` list or a rank file overrode the hostfile). A node that cannot
   read the file goes on to 3: the MPI Operator mounts the hostfile on its
   launcher pod only, while orted passes the variable to every node's ranks.
3. Every rank on one node (the launcher's local size equals the world
   size): 127.0.0.1.

The launcher's own URIs are no help: OMPI_MCA_orte_hnp_uri is mpirun's
host (Kubeflow's launcher pod, which runs no rank) and PMIX_SERVER_URI* the
local daemon of each node. Failing all three, the error names what was
looked at and how to set it. The port is MASTER_PORT, else
`distributed_port` (29500 by default, as in DeepSpeed). With
`init_distributed(auto_mpi_discovery=False)` nothing is looked for (as in
DeepSpeed) and MASTER_ADDR must be set.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HOSTFILE_VARS = ("OMPI_MCA_orte_default_hostfile", "HYDRA_HOST_FILE")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


class MasterDiscoveryError(RuntimeError):
    """Rank 0's address cannot be found for an mpirun-started job; the message says what was looked at."""


@dataclass(frozen=True)
class Master:
    """Where the ranks meet, and where that came from (for the log line)."""

    addr: str
    source: str


def started_by_mpi(environ: Mapping[str, str]) -> bool:
    """True when an MPI launcher (Open MPI, MPICH/Hydra, PMIx) started this process."""
    return any(name in environ for name in _MPI_RANK_VARS)


def own_address() -> str:
    """This machine's first non-loopback IPv4 address (what `hostname -I` prints first), else 127.0.0.1."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        stats = psutil.net_if_stats().get(name)
        for a in addrs:
            if a.family == socket.AF_INET and (stats is None or stats.isup) \
                    and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return "127.0.0.1"


def first_hostfile_host(path: str) -> str | None:
    """The first host of an MPI hostfile (`host slots=N`, `host:N` or `host` lines; `#` comments)."""
    for line in Path(path).read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            return words[0].split(":", 1)[0]
    return None


def _by_mpi4py() -> str | None:
    """Rank 0's address broadcast over MPI_COMM_WORLD; None when mpi4py is not installed."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    return comm.bcast(own_address() if comm.Get_rank() == 0 else None, root=0)


def _from_hostfile(environ: Mapping[str, str], rank: int, unread: list[str]) -> Master | None:
    """The first host of the MPI launcher's hostfile; a hostfile this node cannot read goes into `unread`."""
    from dsrun.launcher.ports import is_local_address

    for var in HOSTFILE_VARS:
        path = environ.get(var)
        if not path:
            continue
        try:
            host = first_hostfile_host(path)
        except OSError as exc:  # e.g. the MPI Operator mounts it on the launcher pod, not on the workers
            unread.append(f"{var}={path} ({exc.strerror} on this node)")
            continue
        if host is None:
            continue
        if rank == 0 and not is_local_address(host):
            raise MasterDiscoveryError(
                f"rank 0 runs on {socket.gethostname()}, not on {host}, the first host of {var}={path} that "
                "dsrun took as rank 0's address (mpirun was given other hosts or a rank file); set "
                "MASTER_ADDR to rank 0's host, e.g. `mpirun -x MASTER_ADDR=...`, or install mpi4py")
        return Master(host, f"the first host of {var}")
    return None


def discover_master(environ: Mapping[str, str], rank: int, world_size: int) -> Master:
    """Rank 0's address for a job an MPI launcher started (see [Note: master address under mpirun]).

    Collective over MPI_COMM_WORLD when mpi4py is used: every rank must call it.

    Raises:
        MasterDiscoveryError: no source gives the address (the message
            names each, and a hostfile this node cannot read), or rank 0 is
            not on the hostfile's first host.
    """
    addr = _by_mpi4py()
    if addr is not None:
        return Master(addr, "rank 0, over MPI (mpi4py)")
    unread: list[str] = []
    found = _from_hostfile(environ, rank, unread)
    if found is not None:
        return found
    local_size = next((environ[v] for v in _LOCAL_SIZE_VARS if v in environ), None)
    if local_size is not None and local_size.strip() == str(world_size):
        return Master("127.0.0.1", "every rank on this node")
    raise MasterDiscoveryError(
        f"this rank was started by MPI with WORLD_SIZE={world_size} on several nodes but MASTER_ADDR is not "
        f"set, and no source gives rank 0's address: mpi4py (pip install mpi4py) is not installed, "
        + (f"the hostfile {', '.join(unread)} cannot be read"
           if unread else f"neither {' nor '.join(HOSTFILE_VARS)} names a hostfile")
        + f", and {'/'.join(_LOCAL_SIZE_VARS)} is not the world size; install mpi4py, or set MASTER_ADDR (and "
        "MASTER_PORT) for every rank, e.g. `mpirun -x MASTER_ADDR=HOST`")

"""Process-group set-up: who this rank is and how it talks to the others.

`init_distributed()` reads the standard rank variables (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a script runs the
same under `dsrun`, `torchrun`, `srun` or as a plain single process, and
returns a `Topology` that the runtime passes around explicitly.

[Note: single process]
With no rank variables set, the process is rank 0 of a world of size 1. We
still create a one-rank process group (backed by an in-memory HashStore, so
no port is opened) so that every collective in `dsrun.runtime.comm` works
the same way at any world size; nothing in the runtime branches on
"is distributed".
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import logging
import os
import sys

import torch
import torch.distributed as dist

from dsrun.accelerator import get_accelerator
from dsrun.launcher.mpi import rank_env_from_scheduler
from dsrun.launcher.ports import DEFAULT_MASTER_PORT
from dsrun.runtime.memory import allocator
from dsrun.runtime.distributed import discovery, rendezvous
from dsrun.runtime.distributed import nodes as nodes_mod
from dsrun.runtime.distributed.exit import freeze_for_exit
from dsrun.runtime.observability import heartbeat

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

_RANK_VARS = ("RANK", "WORLD_SIZE")


class DistributedSetupError(RuntimeError):
    """The rank environment is inconsistent or the process group cannot start."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this rank sits in the job.

    Attributes:
        rank: global rank, 0 <= rank < world_size.
        world_size: number of ranks in the default process group.
        local_rank: rank among the processes on this node.
        local_world_size: number of ranks on this node.
        device: the device this rank computes on (cuda:LOCAL_RANK with NCCL,
            else cpu).
        backend: torch.distributed backend name ("gloo" or "nccl").
        nodes: which node each rank is on (nodes.py, [Note: nodes from the
            rank environment]); None when the rank environment does not
            describe nodes.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    nodes: nodes_mod.NodeMap | None = None

    @property
    def is_rank_zero(self) -> bool:
        """True on global rank 0 (the rank that prints and writes summaries)."""
        return self.rank == 0


def _env_int(name: str, default: int | None = None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistributedSetupError(
            f"environment variable {name}={raw!r} is not an integer; "
            f"unset it or set it to this process's {name.lower()}") from None


def _read_rank_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from the environment.

    Raises:
        DistributedSetupError: only one of RANK/WORLD_SIZE is set, or the
            values are out of range.
    """
    present = [v for v in _RANK_VARS if os.environ.get(v)]
    if not present:
        return 0, 1, 0, 1
    if len(present) != len(_RANK_VARS):
        missing = sorted(set(_RANK_VARS) - set(present))
        raise DistributedSetupError(
            f"{present[0]} is set but {', '.join(missing)} is not; set both RANK and "
            "WORLD_SIZE (a launcher such as dsrun or torchrun does this) or neither "
            "to run as a single process")
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world_size < 1 or not 0 <= rank < world_size:
        raise DistributedSetupError(
            f"RANK={rank} WORLD_SIZE={world_size}: need WORLD_SIZE >= 1 and "
            "0 <= RANK < WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", _env_int("LOCAL_SIZE", world_size))
    return rank, world_size, local_rank, local_world_size


def _pick_backend(requested: str | None) -> str:
    """The requested backend, else the accelerator's: nccl when it is CUDA
    (a GPU is visible and DS_ACCELERATOR does not say "cpu"), else gloo."""
    if requested is not None:
        return requested
    return get_accelerator().communication_backend_name()


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(dist_backend: str | None = None,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                     distributed_port: int | None = None, auto_mpi_discovery: bool = True) -> Topology:
    """Start (or join) the default process group and describe this rank.

    Idempotent: when torch.distributed is already initialised (by an earlier
    call, or by the user's own script), the existing group is described and
    nothing is re-created.

    Args:
        dist_backend: "gloo", "nccl", ... ; default nccl when CUDA is
            available, else gloo.
        timeout: how long a collective may wait for the other ranks before
            failing (instead of hanging for ever).
        distributed_port: used as MASTER_PORT only when the environment sets
            none (DeepSpeed's `distributed_port` argument); default 29500
            for ranks an MPI launcher started.
        auto_mpi_discovery: for ranks an MPI launcher started without
            MASTER_ADDR, find rank 0's address (discovery.py, [Note: master
            address under mpirun]); False: MASTER_ADDR must be set, as
            DeepSpeed then skips its MPI discovery.

    Returns:
        The Topology of this rank. With nccl, the current CUDA device is set
        to cuda:LOCAL_RANK. The first call for a process group is collective
        (every rank learns the node map, see nodes.py).

    Raises:
        DistributedSetupError: inconsistent rank variables, or MASTER_ADDR
            missing for a multi-rank job.
        discovery.MasterDiscoveryError: an MPI-started rank whose rank 0
            address cannot be found.
    """
    allocator.use_returning_allocator()  # see [Note: glibc and peak RSS]
    # A rank started by mpirun/mpiexec or by srun (one task per rank) finds its
    # rank in the launcher's variables; dsrun and torchrun set RANK themselves.
    os.environ.update(rank_env_from_scheduler(os.environ))
    rank, world_size, local_rank, local_world_size = _read_rank_env()
    if dist.is_initialized():
        backend = dist.get_backend()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        device = _device_for(backend, local_rank)
        # Without rank variables the group's ranks are taken to share one node.
        node_rank, node_size = (local_rank, local_world_size) if os.environ.get("RANK") else (rank, world_size)
        heartbeat.start()  # see below
        return Topology(rank, world_size, local_rank, local_world_size, device, backend,
                        nodes_mod.learn(rank, world_size, node_rank, node_size, device))

    backend = _pick_backend(dist_backend)
    device = _device_for(backend, local_rank)
    if world_size == 1 and not os.environ.get("MASTER_ADDR"):
        # See [Note: single process].
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        by_mpi = discovery.started_by_mpi(os.environ)
        if not os.environ.get("MASTER_ADDR") and by_mpi and auto_mpi_discovery:
            _discover_master(rank, world_size, distributed_port)
        if not os.environ.get("MASTER_ADDR"):
            off = " (auto_mpi_discovery=False: not looked for)" if by_mpi else ""
            raise DistributedSetupError(
                f"WORLD_SIZE={world_size} but MASTER_ADDR is not set{off}; set MASTER_ADDR "
                "and MASTER_PORT to rank 0's address (dsrun and torchrun do this)")
        if not os.environ.get("MASTER_PORT"):
            if distributed_port is None:
                raise DistributedSetupError(
                    "MASTER_PORT is not set; set it to a free port on rank 0's host")
            os.environ["MASTER_PORT"] = str(distributed_port)
        # Bounded, and names the ranks that never arrived: see [Note: bounded rendezvous].
        store = rendezvous.join(rank, world_size, os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"),
                                rendezvous.rendezvous_timeout(timeout), timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    atexit.register(_leave)
    # Stacks on request from now on; the first beat comes later. After _leave's registration, so the
    # rank is marked exiting before _leave runs: see [Note: heartbeats].
    heartbeat.start()
    return Topology(rank, world_size, local_rank, local_world_size, device, backend,
                    nodes_mod.learn(rank, world_size, local_rank, local_world_size, device))


def _discover_master(rank: int, world_size: int, distributed_port: int | None) -> None:
    """Set MASTER_ADDR (and MASTER_PORT if unset) for a rank mpirun started: see [Note: master address under mpirun]."""
    master = discovery.discover_master(os.environ, rank, world_size)
    os.environ["MASTER_ADDR"] = master.addr
    os.environ.setdefault("MASTER_PORT", str(distributed_port or DEFAULT_MASTER_PORT))
    if rank == 0:
        print(f"dsrun: MASTER_ADDR={master.addr} MASTER_PORT={os.environ['MASTER_PORT']} ({master.source})",
              flush=True)


def _leave() -> None:
    """At interpreter exit, keep gloo's teardown from turning the rank's exit
    status into an abort: with torch 2.13, gloo objects alive during
    interpreter teardown sometimes abort the process ("terminate called
    without an active exception", exit 134).

    At a clean exit the communication thread finishes its queue, the process
    group dsrun created is destroyed while the interpreter is still whole (no
    collective is issued), and a garbage collection frees gloo objects held
    in reference cycles (a clean-clone CI run saw two MoE jobs end 134 on one
    rank after their last line; not reproduced since); then the rank's files
    are flushed and the collector stops looking at what is alive, which
    makes the rest of the exit cheap ([Note: a cheap exit], exit.py). After an uncaught
    exception (sys.last_value is set before atexit runs) the group is NOT
    torn down -- the rank is failing, and a teardown that waits on peers must
    not delay or hang it -- and the process ends here with Python's status
    for an uncaught exception, 1, its output flushed; exit handlers
    registered before `init_distributed` do not run then. An uncaught
    KeyboardInterrupt is left to Python (it ends the process by SIGINT)."""
    failure = getattr(sys, "last_value", None)
    if failure is not None:
        if isinstance(failure, KeyboardInterrupt):
            return
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or broken pipe: nothing more to save
                pass
        os._exit(1)
    threads = sys.modules.get("dsrun.runtime.comm.comm_thread")
    if threads is not None:  # its queued collectives use the group: let them finish first
        threads.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # gloo objects (work handles, groups) held in reference cycles go now, not in teardown
    freeze_for_exit()  # the collector skips everything alive now: see [Note: a cheap exit]

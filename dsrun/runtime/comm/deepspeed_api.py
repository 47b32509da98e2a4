"""DeepSpeed's `deepspeed.comm` module, over dsrun's collectives.

`dsrun.comm` (and `deepspeed.comm` through the alias distribution) exports
this module's names. The signatures are DeepSpeed's; every collective is
the one in collectives.py or list_collectives.py, so it is counted by
`comms_logger` and, where possible, carried over shared memory.
"""
from __future__ import annotations

import datetime
import os
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from dsrun.runtime.comm import collectives
from dsrun.runtime.comm.collectives import (Handle, all_gather_into_tensor, all_gather_object, all_reduce,
                                            broadcast, get_local_rank, get_rank, get_world_size, is_initialized,
                                            reduce_scatter_tensor, uses_shm)
from dsrun.runtime.comm.list_collectives import (all_gather, all_to_all, all_to_all_single_split,
                                                 broadcast_object_list, gather, irecv, isend, monitored_barrier,
                                                 recv, reduce, reduce_scatter, scatter, send)
from dsrun.runtime.comm.logger import CommsLogger, OpStats, comms_logger, log_summary
from dsrun.runtime.distributed.dist import DEFAULT_TIMEOUT, Topology
from dsrun.runtime.distributed.dist import init_distributed as _init_process_group
from dsrun.runtime.parallel.degrees import ParallelDegrees, declare_mesh, record_declaration
from dsrun.runtime.parallel.mesh import current

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "allgather_fn", "barrier", "broadcast", "broadcast_object_list", "configure",
    "destroy_process_group", "gather", "get_all_ranks_from_group", "get_global_rank", "get_local_rank",
    "get_rank", "get_world_group", "get_world_size", "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor", "inference_all_reduce", "init_distributed", "irecv", "is_available",
    "is_initialized", "isend", "log_summary", "monitored_barrier", "new_group", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send",
    # dsrun's own: the counters and the transport query
    "CommsLogger", "Handle", "OpStats", "comms_logger", "uses_shm",
]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: dict | None = None,
                     rank: int = -1, world_size: int = -1) -> Topology | None:
    """Start the default process group (DeepSpeed's signature); `dsrun.init_distributed`.

    Args:
        dist_backend: "gloo", "nccl", ...; default nccl with CUDA, else gloo.
        auto_mpi_discovery: for ranks mpirun started without MASTER_ADDR,
            find rank 0's address (over MPI with mpi4py, else from the MPI
            launcher's hostfile; dsrun/runtime/distributed/discovery.py);
            False: MASTER_ADDR must be set. The rank itself is read from
            the mpirun/srun variables either way.
        distributed_port: MASTER_PORT when the environment has none.
        verbose: print one line on rank 0 once the group exists.
        timeout: how long a collective waits for the other ranks.
        init_method: None or "env://" (the rank environment), or
            "tcp://HOST:PORT" (rank 0's address).
        dist_init_required: False: do not create a group (one must exist
            already or none is wanted); None/True: create it unless it exists.
        config: a ds_config (dict or path); its "comms_logger" section
            configures the comms logger, and its parallel degrees
            (`pipeline.stages`, `tensor_parallel.autotp_size`,
            `sequence_parallel_size`) build the job's parallelism mesh now,
            on every rank, before the model (see [Note: one declaration of
            the degrees] in runtime/parallel/degrees.py): `dsrun.utils.groups`
            answers from it.
        rank, world_size: this process's rank and the job size when the
            environment does not give them (-1: from the environment).

    Returns:
        This rank's Topology (DeepSpeed returns None), or None with
        dist_init_required=False and no process group.

    Raises:
        ValueError: an init_method other than env:// or tcp://, or rank
            given without world_size.
        dsrun.runtime.config.ConfigError: the config's degrees are invalid
            or their product does not divide the world size.
        dsrun.runtime.distributed.dist.DistributedSetupError: inconsistent rank variables.
    """
    if isinstance(config, dict) and isinstance(config.get("comms_logger"), dict):
        configure(deepspeed_config=config)
    if init_method not in (None, "env://"):
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"init_distributed(init_method={init_method!r}): dsrun accepts env:// or "
                             "tcp://HOST:PORT; set MASTER_ADDR/MASTER_PORT instead")
    if (rank >= 0) != (world_size >= 0):
        raise ValueError(f"init_distributed(rank={rank}, world_size={world_size}): give both or neither")
    if dist.is_initialized() or dist_init_required is False:
        # describes the existing group
        return _declare(config, _init_process_group() if dist.is_initialized() else None)
    if init_method not in (None, "env://"):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = url.hostname, str(url.port)
    if rank >= 0:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    topology = _init_process_group(dist_backend, timeout=timeout, distributed_port=distributed_port,
                                   auto_mpi_discovery=auto_mpi_discovery)
    if verbose and topology.is_rank_zero:
        print(f"dsrun: process group ready: {topology.world_size} ranks, backend {topology.backend}", flush=True)
    return _declare(config, topology)


def _declare(config, topology: Topology | None) -> Topology | None:
    """Build the mesh of `config`'s degrees (collective) when there is a
    config and a process group; returns `topology`."""
    if config is not None and topology is not None:
        # An equal mesh the script already made current is kept: [Note: the declared mesh]
        declared = declare_mesh(ParallelDegrees.from_config(config), current())
        record_declaration(declared, "init_distributed(config=...)")
    return topology


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    collectives.release(group)  # its shared-memory segment, if shm served it
    dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> ProcessGroup:
    """A process group of the given global ranks (every rank must call it, in the same order)."""
    return dist.new_group(ranks)


def get_world_group() -> ProcessGroup:
    """The default group (all ranks)."""
    return dist.group.WORLD


def get_global_rank(group: ProcessGroup | None = None, group_rank: int = 0) -> int:
    """Global rank of rank `group_rank` of `group` (None: the world group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: ProcessGroup | None = None) -> list[int]:
    """Global ranks of `group`, in group-rank order."""
    return [get_global_rank(group, r) for r in range(get_world_size(group))]


def barrier(group: ProcessGroup | None = None, async_op: bool = False, device_ids=None) -> None:
    """Block until every rank of `group` arrives."""
    collectives.barrier(group)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Handle | None:
    """DeepSpeed's all_to_all_single (even blocks, or the given split sizes along dim 0)."""
    if output_split_sizes is None and input_split_sizes is None:
        return collectives.all_to_all_single(output, tensor, group=group, async_op=async_op)
    return all_to_all_single_split(output, tensor, output_split_sizes, input_split_sizes, group, async_op)


def inference_all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                         group: ProcessGroup | None = None) -> None:
    """all_reduce in place (DeepSpeed's low-latency variant is the same operation here)."""
    all_reduce(tensor, op=op, group=group)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup | None = None,
                 async_op: bool = False, debug=None) -> Handle | None:
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                      group: ProcessGroup | None = None, async_op: bool = False, prof: bool = False,
                      debug=None) -> Handle | None:
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def configure(deepspeed_config: dict | None = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """Set up the comms logger from a ds_config dict's "comms_logger" section
    and/or the keyword arguments (which win)."""
    section = dict((deepspeed_config or {}).get("comms_logger", {}))
    for key, value in (("enabled", enabled), ("prof_all", prof_all), ("prof_ops", prof_ops),
                       ("verbose", verbose)):
        if value is not None:
            section[key] = value
    comms_logger.configure(bool(section.get("enabled", comms_logger.enabled)),
                           bool(section.get("verbose", comms_logger.verbose)),
                           bool(section.get("prof_all", comms_logger.prof_all)),
                           section.get("prof_ops", comms_logger.prof_ops))

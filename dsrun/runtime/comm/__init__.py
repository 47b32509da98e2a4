"""Collectives and their accounting (`dsrun.comm`, DeepSpeed's `deepspeed.comm`).

Only this package calls torch.distributed collectives; see collectives.py.
"""
from dsrun.runtime.comm.collectives import (Handle, ReduceOp, all_gather_into_tensor,
                                            all_gather_object, all_reduce, all_to_all_single,
                                            barrier, broadcast, get_local_rank, get_rank,
                                            get_world_size, is_initialized,
                                            reduce_scatter_tensor, uses_shm)
from dsrun.runtime.comm.logger import CommsLogger, OpStats, comms_logger
from dsrun.runtime.distributed.dist import init_distributed

__all__ = [
    "Handle", "ReduceOp", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_to_all_single", "barrier", "broadcast", "get_local_rank", "get_rank", "get_world_size",
    "is_initialized", "reduce_scatter_tensor", "uses_shm", "CommsLogger", "OpStats", "comms_logger",
    "init_distributed",
]

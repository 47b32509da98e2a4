"""The only calls into torch.distributed collectives in dsrun.

Every function takes its process group explicitly (None = the default
group), counts its traffic in `comms_logger`, and with `async_op=True`
returns a handle whose `wait()` blocks until the result is in place (the
torch.distributed Work object). Keeping them in one file makes the whole
communication pattern of the runtime reviewable in one place and lets the
comms logger see every byte.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from dsrun.runtime.comm.logger import comms_logger, timed

Handle = dist.Work


def _issue(name: str, counted: torch.Tensor, async_op: bool, launch) -> Handle | None:
    with timed() as t:
        handle = launch()
    comms_logger.record(name, counted, 0.0 if async_op else t.seconds)
    return handle


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
               group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Reduce `tensor` (any shape/dtype) in place across the ranks of `group`.

    gloo has no ReduceOp.AVG: average by SUM then dividing by the world size.
    """
    return _issue("all_reduce", tensor, async_op,
                  lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
              async_op: bool = False) -> Handle | None:
    """Overwrite `tensor` on every rank with global rank `src`'s copy."""
    return _issue("broadcast", tensor, async_op,
                  lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor,
                           group: ProcessGroup | None = None,
                           async_op: bool = False) -> Handle | None:
    """Concatenate every rank's `input` (shape [n]) into `output` (shape [world*n]), rank order."""
    return _issue("all_gather_into_tensor", output, async_op,
                  lambda: dist.all_gather_into_tensor(output, input, group=group,
                                                      async_op=async_op))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor,
                          op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                          async_op: bool = False) -> Handle | None:
    """Reduce `input` (shape [world*n]) across ranks; rank r keeps slice r in `output` ([n])."""
    return _issue("reduce_scatter_tensor", input, async_op,
                  lambda: dist.reduce_scatter_tensor(output, input, op=op, group=group,
                                                     async_op=async_op))


def all_gather_object(obj: object, group: ProcessGroup | None = None) -> list[object]:
    """Every rank's picklable `obj`, in rank order (small control data only: it pickles)."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    comms_logger.record("all_gather_object", torch.empty(0))
    return out


def barrier(group: ProcessGroup | None = None) -> None:
    """Block until every rank of `group` reaches this call."""
    dist.barrier(group=group)
    comms_logger.record("barrier", torch.empty(0))


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in `group` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """LOCAL_RANK from the rank environment (0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_initialized()

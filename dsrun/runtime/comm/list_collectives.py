"""The rest of DeepSpeed's comm API: collectives the runtime itself does not
issue, for scripts that call them through `dsrun.comm` (`deepspeed.comm`).

List forms (all_gather into a list, reduce_scatter from a list,
all_to_all), rooted ones (reduce, gather, scatter), point-to-point
(send/recv and their async forms), broadcast_object_list and
monitored_barrier. They run on torch.distributed (gloo on CPU, nccl on
CUDA) with torch's semantics, and each is counted in `comms_logger` under
its name like the collectives in collectives.py (elements: the full
message, as DeepSpeed's comms logger counts it).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from dsrun.runtime.comm.collectives import Handle, _issue, _served


def _total(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A tensor whose numel/element size stand for the whole list (for counting only)."""
    dtype = tensors[0].dtype if tensors else torch.uint8
    return torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device="meta")  # no storage


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None,
               async_op: bool = False) -> Handle | None:
    """tensor_list[r] receives rank r's `tensor` (all the same shape and dtype)."""
    return _issue("all_gather", _total(tensor_list), group, async_op, None, None,
                  lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op))


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """`output` on rank r = input_list[r] reduced over all ranks."""
    return _issue("reduce_scatter", _total(input_list), group, async_op, None, None,
                  lambda: dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op))


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """input_tensor_list[j] goes to rank j; output_tensor_list[i] comes from rank i."""
    return _issue("all_to_all", _total(input_tensor_list), group, async_op, None, None,
                  lambda: dist.all_to_all(output_tensor_list, input_tensor_list, group=group,
                                          async_op=async_op))


def all_to_all_single_split(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                            input_split_sizes: list[int] | None, group: ProcessGroup | None = None,
                            async_op: bool = False) -> Handle | None:
    """all_to_all_single with uneven blocks: input rows [sum(in[:j]), +in[j]) go to rank j.
    On a group shm serves it runs there (comm/collectives.py [Note: choosing
    the transport]); `output` must then not overlap `input`."""
    return _issue("all_to_all_single", input, group, async_op, lambda: _served(group, output, input),
                  lambda shm: shm.all_to_all(output, input, output_split_sizes, input_split_sizes),
                  lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                 group=group, async_op=async_op))


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
           async_op: bool = False) -> Handle | None:
    """Global rank `dst` gets `tensor` reduced over the group (others' tensors are unspecified)."""
    return _issue("reduce", tensor, group, async_op, None, None,
                  lambda: dist.reduce(tensor, dst, op=op, group=group, async_op=async_op))


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Global rank `dst` receives every rank's `tensor` in gather_list (None on the others)."""
    return _issue("gather", tensor, group, async_op, None, None,
                  lambda: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op))


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Rank r receives scatter_list[r] of global rank `src` into `tensor`."""
    return _issue("scatter", tensor, group, async_op, None, None,
                  lambda: dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op))


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send `tensor` to global rank `dst` (blocks until it is sent)."""
    _issue("send", tensor, group, False, None, None, lambda: dist.send(tensor, dst, group=group, tag=tag))


def recv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None,
         tag: int = 0) -> int:
    """Receive into `tensor` from global rank `src` (any rank when None); returns the sender."""
    sender = []
    _issue("recv", tensor, group, False, None, None,
           lambda: sender.append(dist.recv(tensor, src, group=group, tag=tag)))
    return sender[0]


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Handle:
    """Asynchronous send; wait() on the handle before reusing `tensor`."""
    return _issue("isend", tensor, group, True, None, None, lambda: dist.isend(tensor, dst, group=group, tag=tag))


def irecv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None,
          tag: int = 0) -> Handle:
    """Asynchronous receive; `tensor` holds the data after wait()."""
    return _issue("irecv", tensor, group, True, None, None, lambda: dist.irecv(tensor, src, group=group, tag=tag))


def broadcast_object_list(object_list: list, src: int = 0, group: ProcessGroup | None = None) -> None:
    """Replace object_list's items on every rank by global rank `src`'s (picklable, small)."""
    _issue("broadcast_object_list", torch.empty(0), group, False, None, None,
           lambda: dist.broadcast_object_list(object_list, src=src, group=group))


def monitored_barrier(group: ProcessGroup | None = None, timeout: datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive within `timeout` (gloo only)."""
    _issue("monitored_barrier", torch.empty(0), group, False, None, None,
           lambda: dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks))

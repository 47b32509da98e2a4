"""Point-to-point transfers between pipeline stages: activations go to the
next stage, their gradients come back.

[Note: tensor metadata per micro-batch]
A stage's output is a tensor or a tuple of tensors whose shapes may change
from one micro-batch to the next (variable sequence lengths). Both ends
remember the last shapes that went between them (per peer), so an
activation whose shapes did not change is ONE message: an 8-byte mark 0,
then every tensor's bytes, each at a 64-byte aligned offset (`_layout`),
copied into one buffer by the sender and received as views of one fresh
buffer (one send and one receive call per activation, and one wake-up of a
sleeping receiver, instead of a header message and one message per tensor).
When they changed, the sender sends, in the size the receiver expects (the
old shapes' packed size; 8 bytes before the first message), the mark `n >
0`, then a header of `n` int64s describing every tensor (dtype code,
requires_grad, ndim, shape...), then each tensor as its own message. So an
unchanged shape costs 8 bytes beside the data and a changed one is always
announced (DeepSpeed sends the shapes once, for the first micro-batch only,
and breaks on variable lengths). Gradients travel back without a header:
they have the shapes of the activations that were sent, which the sending
side kept.

Messages to one rank are matched in the order they were sent; activations
and gradients use different tags so that the two streams between a pair of
ranks never match each other (gloo matches by tag; NCCL ignores tags and
matches by order, which the schedules give for one stream per pair).

[Note: the transport of a stage link]
Between two ranks of one node on the CPU, the messages go through shared
memory: one `ShmChannel` (dsrun/ops/shm_comm.py) per (sender, receiver,
tag), a ring of slots the sender copies into and the receiver copies out of,
so activations and gradients stay separate ordered streams as with tags.
Elsewhere (ranks on different nodes, GPU tensors, DSRUN_SHM_COMM=0, the
native op unavailable on either rank) they go through torch.distributed's
isend/irecv (gloo over loopback TCP: on one node its median one-way time
was 4-31x shm's up to 1 MiB and 1.6-3x above, bench/pipeline/README.md). Which ranks use which is agreed once when the
link is made (shm_peers.py), so both ends of a pair always pick the same
transport; every message of the pair then uses it. Sends stay asynchronous:
a message that fits the ring's free slots is copied at once, the rest of a
larger one by the channel's sender thread (see [Note: asynchronous channel
sends] in shm_comm.py), and `wait_sends` waits for all of them. A receiver
whose sender died fails within about 16 ms, naming it; one whose
sender is alive but silent fails after DSRUN_SHM_TIMEOUT (300 s), where
gloo would wait for the process group's timeout. The comms logger counts
the messages under "isend"/"irecv" either way, with transport "shm" or
"torch".
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from dsrun.runtime.comm.collectives import SHM
from dsrun.runtime.comm.list_collectives import irecv, isend
from dsrun.runtime.comm.logger import comms_logger, timed
from dsrun.runtime.parallel.pipe.shm_peers import ShmPeers

ACTIVATION_TAG = 1
GRADIENT_TAG = 2

# dtype <-> code in the header; the order is part of the wire format.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_CODE = {dtype: i for i, dtype in enumerate(_DTYPES)}

Tensors = tuple[torch.Tensor, ...]


def as_tensors(value, what: str) -> Tensors:
    """`value` (a tensor or a tuple/list of tensors) as a tuple of tensors.

    Raises:
        TypeError: `value` holds something other than tensors; `what` names
            the stage output in the message.
    """
    items = (value,) if isinstance(value, torch.Tensor) else value
    if not isinstance(items, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError(f"{what} must be a tensor or a tuple of tensors to travel between pipeline "
                        f"stages, got {type(value).__name__}; return tensors from the stage's last layer")
    return tuple(items)


def _header(tensors: Tensors) -> list[int]:
    out = []
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"a pipeline stage output has dtype {t.dtype}, which cannot travel between "
                            f"stages; use one of {[str(d) for d in _DTYPES]}")
        out += [_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    return out


_ALIGN = 64  # bytes: where each tensor starts in a packed message (any dtype's alignment, a cache line)


def _layout(specs) -> tuple[list[int], int]:
    """The byte offset of every tensor of `specs` (as `_parse` returns) in a
    packed activation message, and the message's size: the 8-byte mark
    first, each tensor from the next multiple of `_ALIGN`."""
    offsets, end = [], 8
    for dtype, _, shape in specs:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + math.prod(shape) * dtype.itemsize
    return offsets, end


def _parse(header: list[int]) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    specs, i = [], 0
    while i < len(header):
        dtype, grad, ndim = _DTYPES[header[i]], bool(header[i + 1]), header[i + 2]
        specs.append((dtype, grad, tuple(header[i + 3:i + 3 + ndim])))
        i += 3 + ndim
    return specs


class StageLink:
    """This rank's sends and receives to its pipeline neighbours.

    Sends are asynchronous (the tensors are kept until `wait_sends`);
    receives block. Ranks are global ranks of the default process group.
    Construct it on every rank at the same point (it agrees on the
    transport with one all-gather, see [Note: the transport of a stage link]).

    Args:
        device: where received tensors are allocated (this rank's compute device).

    Attributes:
        wait_seconds: wall time spent blocked in receives and in
            `wait_sends` since the last `reset_wait` -- the stage's time
            waiting on its neighbours (its share of the pipeline bubble).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.wait_seconds = 0.0
        # per peer, the last shapes sent / received: (header or specs, their packed layout)
        self._sent: dict[int, tuple[list[int], tuple[list[int], int]]] = {}
        self._recv_specs: dict[int, tuple[list, tuple[list[int], int]]] = {}
        self._pending: list = []  # (handle, tensors kept alive until the send completes)
        self._shm = ShmPeers(device)

    def send_activations(self, value, dst: int) -> None:
        """Send a stage output (tensor or tuple) to rank `dst`: one packed
        message when its shapes are those of the last one to `dst`, else the
        announcement, the header and the tensors (see [Note: tensor metadata
        per micro-batch])."""
        outputs = as_tensors(value, "a pipeline stage output")
        header = _header(outputs)
        tensors = [t.detach().contiguous() for t in outputs]
        last = self._sent.get(dst)
        if last is not None and last[0] == header:
            offsets, size = last[1]
            packed = torch.empty(size, dtype=torch.uint8, device=self.device)
            packed[:8].view(torch.int64).zero_()
            for t, at in zip(tensors, offsets):
                packed[at:at + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
            self._isend([packed], dst, ACTIVATION_TAG)
            return
        # the announcement, in the size the receiver expects: the last shapes' packed message
        mark = torch.zeros(last[1][1] if last is not None else 8, dtype=torch.uint8, device=self.device)
        mark[:8].view(torch.int64).fill_(len(header))
        self._sent[dst] = (header, _layout(_parse(header)))
        self._isend([mark, torch.tensor(header, dtype=torch.int64, device=self.device), *tensors], dst,
                    ACTIVATION_TAG)

    def recv_activations(self, src: int) -> Tensors:
        """Receive a stage input from rank `src`: fresh tensors, those whose
        sender required grad marked `requires_grad` (leaves of this stage's graph)."""
        started = time.perf_counter()
        known = self._recv_specs.get(src)
        packed = self._recv(torch.empty(known[1][1] if known is not None else 8, dtype=torch.uint8,
                                        device=self.device), src, ACTIVATION_TAG)
        length = packed[:8].view(torch.int64).item()
        if length == 0:  # the last shapes, packed in this one message
            specs, (offsets, _) = known
            out = [packed[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                   for (dtype, _, shape), at in zip(specs, offsets)]
        else:
            header = self._recv(torch.empty(length, dtype=torch.int64, device=self.device), src, ACTIVATION_TAG)
            specs = _parse(header.tolist())
            self._recv_specs[src] = (specs, _layout(specs))
            out = [self._recv(torch.empty(shape, dtype=dtype, device=self.device), src, ACTIVATION_TAG)
                   for dtype, _, shape in specs]
        for t, (dtype, grad, _) in zip(out, specs):
            t.requires_grad_(grad and dtype.is_floating_point)
        self.wait_seconds += time.perf_counter() - started
        return tuple(out)

    def send_gradients(self, grads: Sequence[torch.Tensor], dst: int) -> None:
        """Send the gradients of a received stage input back to rank `dst`
        (one per input tensor that required grad, in order)."""
        self._isend([g.contiguous() for g in grads], dst, GRADIENT_TAG)

    def recv_gradients(self, like: Sequence[torch.Tensor], src: int) -> Tensors:
        """Receive from rank `src` the gradients of the activations `like`
        that this rank sent it (those that required grad)."""
        started = time.perf_counter()
        out = []
        for t in like:
            g = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            self._recv(g, src, GRADIENT_TAG)
            out.append(g)
        self.wait_seconds += time.perf_counter() - started
        return tuple(out)

    def _isend(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        if not self._shm.reaches(dst):
            for t in tensors:
                self._pending.append((isend(t, dst, tag=tag), t))
            return
        channel = self._shm.channel(self._shm.rank, dst, tag)
        for t in tensors:
            with timed() as spent:
                handle = channel.send(t)
            comms_logger.record("isend", t, spent.seconds, transport=SHM, group_size=2)
            self._pending.append((handle, t))

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        """Receive the next message of stream (src, tag) into `tensor`, blocking; returns it."""
        if not self._shm.reaches(src):
            irecv(tensor, src, tag=tag).wait()
            return tensor
        with timed() as spent:
            self._shm.channel(src, self._shm.rank, tag).recv(tensor)
        comms_logger.record("irecv", tensor, spent.seconds, transport=SHM, group_size=2)
        return tensor

    def wait_sends(self) -> None:
        """Block until every send issued so far has completed (before the
        tensors may be freed or reused: at the latest at the step's end)."""
        started = time.perf_counter()
        for handle, _ in self._pending:
            handle.wait()
        self._pending.clear()
        self.wait_seconds += time.perf_counter() - started

    def reset_wait(self) -> None:
        """Start counting `wait_seconds` from zero."""
        self.wait_seconds = 0.0

    def close(self) -> None:
        """Close the shared-memory channels (after `wait_sends`); the link
        cannot be used afterwards. Without it they close when the process exits."""
        self._shm.close()

"""Shared-memory collectives for the ranks of one node (csrc/shm_comm/).

For the communication layer (dsrun/runtime/comm/): when every rank of a group
runs on this node and the tensors are contiguous CPU tensors, these replace
gloo's collectives, which on one machine are slower than a memory copy
(REFERENCE.md §6). Where the op is unavailable (`available()` is False) the
caller keeps using torch.distributed; that is the fallback, with the same
semantics.

    group = ShmGroup(name, rank, world_size, barrier=lambda: dist.barrier(pg))
    group.all_reduce(t)                    # in place, sum (or "max", "min")
    group.reduce_scatter(out, inp)         # inp [world * n] -> out [n]
    group.all_gather(out, inp)             # inp [n] -> out [world * n]
    group.broadcast(t, src=0)
    group.all_to_all(out, inp)             # inp [world * n] -> out [world * n], block j to rank j
    group.all_to_all(out, inp, out_splits, in_splits)  # uneven blocks (rows of dim 0)

Point-to-point, between two ranks of this node (pipeline activations and
gradients, dsrun/runtime/parallel/pipe/p2p.py):

    out = ShmChannel(name, rank, src=rank, dst=peer, tag=1)
    handle = out.send(t)                   # returns once t is copied or queued
    handle.wait()                          # before t may change
    inp = ShmChannel(name, rank, src=peer, dst=rank, tag=1)
    inp.recv(t)                            # blocks until the next message is in t

Every rank of the group must make the same calls in the same order with the
same sizes, as with any collective; a call that differs on some rank
(operation, dtype, element count, root, reduce op, or its place in the
sequence) fails on every rank with a ShmCollectiveError naming rank 0's call
and the differing rank's, before any data is read. See [Note: shm collective
protocol], [Note: shm call check] and [Note: shm crash safety] in
csrc/shm_comm/shm_comm.cpp, and [Note: shm channel protocol] and [Note: shm
channel set-up and crash safety] in csrc/shm_comm/shm_channel.cpp.

[Note: asynchronous channel sends]
`ShmChannel.send` copies the message into the channel's ring at once as far
as free slots allow (all of it when the message fits, the common case for
activations); what does not fit is finished by the channel's sender thread
(one per channel, started on first need), which waits for the receiver to
free slots. The caller goes on computing either way, as with gloo's isend,
and `wait()` on the handle blocks until the last byte is in the ring (not
until it was received). A message queued behind the thread keeps its place:
later sends on the channel queue behind it, so messages stay in order. The
thread matters for correctness, not only speed: finishing a large send only
in `wait()` would deadlock a pipeline whose receiver needs that message
before it sends what the sender waits for. ctypes releases the GIL while
the thread copies or waits.
"""
from __future__ import annotations

import collections
import ctypes
import os
import threading
from itertools import accumulate
from typing import Callable

import torch

from dsrun.env import JOB_ID, SHM_TIMEOUT
from dsrun.ops.builder import get_op

REDUCE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Codes naming a call's dtype in [Note: shm call check]; the native side
# prints names in this order. Others travel as _OTHER_DTYPE.
DTYPE_CODES = {dt: i for i, dt in enumerate((
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128))}
_OTHER_DTYPE = 255
OPS = {"sum": 0, "max": 1, "min": 2}
DEFAULT_SLOT_BYTES = 4 << 20  # 2 buffers x 2 ranks x 4 MiB stay in a 32 MiB L3 between copy and read
CHANNEL_SLOT_BYTES = 1 << 20  # a point-to-point channel's ring: 8 slots of 1 MiB (bench/pipeline/p2p_shm.py)
CHANNEL_SLOTS = 8
_ERRLEN = 512


class ShmCollectiveError(RuntimeError):
    """A shared-memory collective failed: a rank died, flagged an error, or timed out."""


class ShmChannelError(RuntimeError):
    """A shared-memory point-to-point transfer failed: the peer died, closed the
    channel, a message had another size than the receiver expected, or the
    wait timed out (DSRUN_SHM_TIMEOUT)."""


def _native():
    lib = get_op("shm_comm").load()
    if lib is not None and not hasattr(lib, "_dsrun_typed"):
        lib.dsrun_shm_open.restype = ctypes.c_void_p
        lib.dsrun_shm_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                       ctypes.c_double, ctypes.c_char_p, ctypes.c_int]
        lib.dsrun_shm_close.argtypes = [ctypes.c_void_p]
        lib.dsrun_shm_unlink.argtypes = [ctypes.c_char_p]
        err = [ctypes.c_char_p, ctypes.c_int]
        lib.dsrun_shm_barrier.argtypes = [ctypes.c_void_p, *err]
        lib.dsrun_shm_all_reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                             ctypes.c_int, *err]
        lib.dsrun_shm_reduce_scatter.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int, ctypes.c_int, *err]
        lib.dsrun_shm_all_gather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_int, ctypes.c_int64, *err]
        lib.dsrun_shm_broadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                            ctypes.c_int, ctypes.c_int64, *err]
        sizes = ctypes.POINTER(ctypes.c_int64)
        lib.dsrun_shm_all_to_all.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, sizes, sizes, sizes,
                                             sizes, ctypes.c_int, ctypes.c_int64, *err]
        lib.dsrun_shm_chan_open.restype = ctypes.c_void_p
        lib.dsrun_shm_chan_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_double, *err]
        lib.dsrun_shm_chan_abort.argtypes = [ctypes.c_void_p]
        lib.dsrun_shm_chan_close.argtypes = [ctypes.c_void_p]
        lib.dsrun_shm_chan_send.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, *err]
        lib.dsrun_shm_chan_recv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, *err]
        lib._dsrun_typed = True
    return lib


def available() -> bool:
    """True if the native op is built and loaded (else use torch.distributed)."""
    return _native() is not None


def segment_name(job_id: str, group: str) -> str:
    """A POSIX shm name unique to the job and group: "/dsrun-<job>-<group>" with
    characters outside [A-Za-z0-9_.-] replaced."""
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in f"{job_id}-{group}")
    return f"/dsrun-{safe}"[:250]


def supports(*tensors: torch.Tensor, reduce: bool = True) -> bool:
    """True if these tensors can use the shared-memory path: contiguous CPU
    tensors, and for reductions fp32, bf16 or fp16."""
    return all(t.device.type == "cpu" and t.is_contiguous() and (not reduce or t.dtype in REDUCE_DTYPES)
               for t in tensors)


class ShmGroup:
    """A group of ranks on this node sharing one segment.

    Args:
        name: segment name, the same on every rank and unique to the job and
            group (see `segment_name`).
        rank, world_size: this rank's index in the group and the group size.
        barrier: a collective barrier over the same ranks (e.g.
            `lambda: dist.barrier(group)`), used only while setting up.
        slot_bytes: bytes each rank stages per step (2 x world_size slots
            are allocated); larger tensors go in several steps.
        timeout_s: how long a rank waits for the others inside a collective
            before raising (default $DSRUN_SHM_TIMEOUT or 300 s).

    Raises:
        RuntimeError: the native op is unavailable (check `available()` first).
        ShmCollectiveError: the segment cannot be created or attached.
    """

    def __init__(self, name: str, rank: int, world_size: int, barrier: Callable[[], None],
                 slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float | None = None):
        lib = _native()
        if lib is None:
            raise RuntimeError(f"shared-memory collectives unavailable: {get_op('shm_comm').reason}")
        self._lib, self.rank, self.world_size, self.name = lib, rank, world_size, name
        timeout_s = SHM_TIMEOUT.read() if timeout_s is None else timeout_s
        slot_bytes = max(64, slot_bytes // 64 * 64)
        err = ctypes.create_string_buffer(_ERRLEN)
        self._h = None
        try:
            if rank == 0:
                self._h = lib.dsrun_shm_open(name.encode(), rank, world_size, slot_bytes, 1, timeout_s, err, _ERRLEN)
            barrier()  # segment exists (or rank 0 failed and the others fail to attach)
            if rank != 0:
                self._h = lib.dsrun_shm_open(name.encode(), rank, world_size, slot_bytes, 0, timeout_s, err, _ERRLEN)
            barrier()  # every rank has mapped it
        finally:
            if rank == 0:
                lib.dsrun_shm_unlink(name.encode())  # see [Note: shm crash safety]
        if not self._h:
            raise ShmCollectiveError(f"rank {rank}: {err.value.decode()}")

    def close(self) -> None:
        """Unmap the segment (the kernel frees it when the last rank closes or exits)."""
        if self._h:
            self._lib.dsrun_shm_close(self._h)
            self._h = None

    def __del__(self):
        if getattr(self, "_h", None):  # __init__ got that far
            self.close()

    def _call(self, fn, *args) -> None:
        if not self._h:
            raise ShmCollectiveError(f"rank {self.rank}: the group is closed (after an earlier error, or by "
                                     "close()); collectives on it cannot run")
        err = ctypes.create_string_buffer(_ERRLEN)
        if fn(self._h, *args, err, _ERRLEN) != 0:
            # The ranks may now be at different buffer steps: a later call
            # would read the wrong slots, so the group is done.
            self.close()
            raise ShmCollectiveError(f"rank {self.rank}: {err.value.decode()}")

    @staticmethod
    def _check(name: str, t: torch.Tensor, reduce: bool) -> None:
        if not supports(t, reduce=reduce):
            raise ValueError(f"{name}: need a contiguous CPU tensor{' of fp32, bf16 or fp16' if reduce else ''}, "
                             f"got {t.dtype} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")

    def barrier(self) -> None:
        """Wait for every rank of the group."""
        self._call(self._lib.dsrun_shm_barrier)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` (any shape, fp32/bf16/fp16) over the ranks, in place;
        16-bit values are accumulated in fp32 and rounded once. Returns tensor."""
        self._check("all_reduce", tensor, True)
        self._call(self._lib.dsrun_shm_all_reduce, tensor.data_ptr(), tensor.numel(), REDUCE_DTYPES[tensor.dtype],
                   OPS[op])
        return tensor

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """output [n] = reduction over ranks of input[rank*n:(rank+1)*n], input [world*n]."""
        self._check("reduce_scatter output", output, True)
        self._check("reduce_scatter input", input, True)
        if input.dtype != output.dtype or input.numel() != output.numel() * self.world_size:
            raise ValueError(f"reduce_scatter: input must have world_size ({self.world_size}) x output's "
                             f"{output.numel()} elements of {output.dtype}, got {input.numel()} of {input.dtype}")
        self._call(self._lib.dsrun_shm_reduce_scatter, output.data_ptr(), input.data_ptr(), output.numel(),
                   REDUCE_DTYPES[output.dtype], OPS[op])
        return output

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """output [world*n] = concatenation of every rank's input [n] (any dtype)."""
        self._check("all_gather output", output, False)
        self._check("all_gather input", input, False)
        if input.dtype != output.dtype or output.numel() != input.numel() * self.world_size:
            raise ValueError(f"all_gather: output must have world_size ({self.world_size}) x input's "
                             f"{input.numel()} elements of {input.dtype}, got {output.numel()} of {output.dtype}")
        self._call(self._lib.dsrun_shm_all_gather, output.data_ptr(), input.data_ptr(),
                   input.numel() * input.element_size(), DTYPE_CODES.get(input.dtype, _OTHER_DTYPE),
                   input.numel())
        return output

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Copy rank `src`'s tensor (any dtype) to every rank, in place."""
        self._check("broadcast", tensor, False)
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} outside the group of {self.world_size} ranks")
        self._call(self._lib.dsrun_shm_broadcast, tensor.data_ptr(), tensor.numel() * tensor.element_size(), src,
                   DTYPE_CODES.get(tensor.dtype, _OTHER_DTYPE), tensor.numel())
        return tensor

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None = None,
                   input_splits: list[int] | None = None) -> torch.Tensor:
        """Personalised exchange (any dtype): block j of `input` goes to rank j
        and `output` holds, in rank order, the block each rank sent here
        ([Note: shm all-to-all] in csrc/shm_comm/shm_comm.cpp).

        Without splits both tensors have world x n elements cut into equal
        blocks of n. With splits (torch's all_to_all_single convention) the
        blocks are runs of rows along dim 0: input_splits[j] rows go to rank j
        and output_splits[i] rows come from rank i; rank i's input_splits[j]
        must equal rank j's output_splits[i]. `output` must not overlap
        `input`. Returns output.

        Raises:
            ValueError: not contiguous CPU tensors, different dtypes, sizes
                that do not match the splits or the group.
            ShmCollectiveError: a rank failed or the ranks' calls or split
                sizes disagree (the rank that sees it fails at once, the others
                at their next call on the group).
        """
        self._check("all_to_all output", output, False)
        self._check("all_to_all input", input, False)
        world = self.world_size
        if input.dtype != output.dtype:
            raise ValueError(f"all_to_all: input is {input.dtype}, output {output.dtype}; they must match")
        es = input.element_size()
        if output_splits is None and input_splits is None:
            if input.numel() % world or output.numel() != input.numel():
                raise ValueError(f"all_to_all: input and output must have the same number of elements, a "
                                 f"multiple of the group's {world} ranks; got {input.numel()} and {output.numel()}")
            n = input.numel() // world
            send = recv = [n * es] * world
            count = n
        else:
            send = self._block_bytes("input", input, input_splits)
            recv = self._block_bytes("output", output, output_splits)
            if send[self.rank] != recv[self.rank]:
                raise ValueError(f"all_to_all: rank {self.rank} sends itself {send[self.rank]} bytes but expects "
                                 f"{recv[self.rank]}; input_splits[{self.rank}] must equal "
                                 f"output_splits[{self.rank}]")
            count = -1
        array = ctypes.c_int64 * world
        self._call(self._lib.dsrun_shm_all_to_all, output.data_ptr(), input.data_ptr(), array(*send),
                   array(*accumulate(send[:-1], initial=0)), array(*recv), array(*accumulate(recv[:-1], initial=0)),
                   DTYPE_CODES.get(input.dtype, _OTHER_DTYPE), count)
        return output

    def _block_bytes(self, what: str, t: torch.Tensor, splits: list[int] | None) -> list[int]:
        """Bytes of each rank's block of `t`: `splits` rows of dim 0 each, or equal blocks."""
        world, nbytes = self.world_size, t.numel() * t.element_size()
        if splits is None:
            if t.dim() == 0 or t.shape[0] % world:
                raise ValueError(f"all_to_all: {what} of shape {tuple(t.shape)} cannot be cut into {world} "
                                 "equal blocks along dim 0; pass its split sizes")
            return [nbytes // world] * world
        if len(splits) != world or any(s < 0 for s in splits) or t.dim() == 0 or sum(splits) != t.shape[0]:
            raise ValueError(f"all_to_all: {what} splits {list(splits)} must be {world} sizes >= 0 summing to "
                             f"dim 0 of {tuple(t.shape)}")
        row = nbytes // t.shape[0] if t.shape[0] else 0
        return [s * row for s in splits]


def world_group_from_env(barrier: Callable[[], None], group: str = "world",
                         slot_bytes: int = DEFAULT_SLOT_BYTES) -> ShmGroup | None:
    """A ShmGroup over the default process group when every rank is on this node, else None.

    Reads RANK, WORLD_SIZE and LOCAL_WORLD_SIZE (set by dsrun and torchrun);
    the segment is named after DSRUN_JOB_ID, or MASTER_ADDR:MASTER_PORT under
    torchrun, so concurrent jobs never share one. Returns None (the caller
    keeps gloo) when ranks span nodes, LOCAL_WORLD_SIZE is unset, or the op is
    unavailable. Every rank must call it (it runs `barrier` twice).
    """
    environ = os.environ
    world = int(environ.get("WORLD_SIZE", "1"))
    if not available() or environ.get("LOCAL_WORLD_SIZE") != str(world):
        return None
    return ShmGroup(segment_name(job_name(), group), int(environ.get("RANK", "0")), world, barrier,
                    slot_bytes=slot_bytes)


def job_name() -> str:
    """What names this job's segments: DSRUN_JOB_ID, or MASTER_ADDR_MASTER_PORT
    under torchrun, so concurrent jobs never share one."""
    return JOB_ID.read() or f"{os.environ.get('MASTER_ADDR', 'local')}_{os.environ.get('MASTER_PORT', '0')}"


def channel_name(job_id: str, link: int, src: int, dst: int, tag: int) -> str:
    """The segment name of channel src -> dst for `tag` of the job's `link`-th
    set of channels (a number every rank counts alike)."""
    return segment_name(job_id, f"p2p{link}-{src}-{dst}-{tag}")


class SendHandle:
    """What `ShmChannel.send` returns: `wait()` blocks until the message is
    wholly in the channel's ring (the tensor may then change) and raises
    ShmChannelError if the send failed."""

    __slots__ = ("_done", "_error", "_tensor")

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self._tensor = tensor  # kept alive while the sender thread copies it
        self._done = None if tensor is None else threading.Event()
        self._error: str | None = None

    def _finish(self, error: str | None = None) -> None:
        self._error, self._tensor = error, None
        self._done.set()

    def wait(self, timeout=None) -> bool:
        """Block until sent (into the ring); True. Raises ShmChannelError on failure."""
        if self._done is not None:
            self._done.wait()
        if self._error is not None:
            raise ShmChannelError(self._error)
        return True

    def is_completed(self) -> bool:
        return self._done is None or self._done.is_set()


class ShmChannel:
    """One direction of point-to-point traffic between two ranks of this node,
    for one tag: a ring of `slots` slots of `slot_bytes` in shared memory
    (see [Note: shm channel protocol] in csrc/shm_comm/shm_channel.cpp).

    The rank `src` sends, the rank `dst` receives; messages are raw bytes of
    contiguous CPU tensors of any dtype and size (larger than the ring too)
    and arrive in the order sent. The sender's end creates the segment when
    constructed, without waiting; the receiver's end attaches on its first
    `recv`, waiting for the sender to have created it.

    Args:
        name: segment name, the same on both ranks and unique to the job,
            pair and tag (see `channel_name`).
        rank: this process's rank, `src` or `dst`.
        src, dst: the sending and receiving ranks (any numbering both use).
        tag: the stream (activations and gradients between the same ranks
            are separate channels).
        slot_bytes, slots: the ring; both ends must pass the same values.
        peer_pid: the other rank's process id where known (lets a receiver
            whose sender died before creating the segment fail at once
            instead of at the timeout); 0 if unknown.
        timeout_s: longest wait for the peer in one call (default
            $DSRUN_SHM_TIMEOUT or 300 s).

    Raises:
        RuntimeError: the native op is unavailable (check `available()` first).
        ValueError: bad ranks or ring shape.
        ShmChannelError: the segment cannot be created.
    """

    def __init__(self, name: str, rank: int, src: int, dst: int, tag: int,
                 slot_bytes: int = CHANNEL_SLOT_BYTES, slots: int = CHANNEL_SLOTS,
                 peer_pid: int = 0, timeout_s: float | None = None) -> None:
        lib = _native()
        if lib is None:
            raise RuntimeError(f"shared-memory channels unavailable: {get_op('shm_comm').reason}")
        if src == dst or rank not in (src, dst):
            raise ValueError(f"ShmChannel: rank {rank} is neither end of {src} -> {dst} (they must differ)")
        if slot_bytes < 64 or slot_bytes % 64 or slots < 1:
            raise ValueError(f"ShmChannel: slot_bytes {slot_bytes} must be a positive multiple of 64 and "
                             f"slots {slots} at least 1")
        self._lib, self.name, self.rank, self.src, self.dst, self.tag = lib, name, rank, src, dst, tag
        self.slot_bytes, self.slots, self.peer_pid = slot_bytes, slots, peer_pid
        self.timeout_s = SHM_TIMEOUT.read() if timeout_s is None else timeout_s
        self._h = None
        self._error: str | None = None
        self._cond = threading.Condition()
        self._queue: collections.deque[SendHandle] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        if rank == src:
            self._h = self._open()

    def __repr__(self) -> str:
        return f"ShmChannel(rank {self.src} -> rank {self.dst}, tag {self.tag})"

    def _open(self):
        err = ctypes.create_string_buffer(_ERRLEN)
        h = self._lib.dsrun_shm_chan_open(self.name.encode(), self.rank, self.src, self.dst, self.tag,
                                          self.slot_bytes, self.slots, self.peer_pid, self.timeout_s, err, _ERRLEN)
        if not h:
            raise ShmChannelError(f"rank {self.rank}: {err.value.decode()}")
        return h

    def _usable(self, role: int, what: str) -> None:
        if self.rank != role:
            raise ValueError(f"{what} on {self!r} from rank {self.rank}: only rank {role} may {what}")
        if self._error is not None:
            raise ShmChannelError(f"{self!r} failed earlier: {self._error}")
        if self._closing:
            raise ShmChannelError(f"{self!r} is closed")

    @staticmethod
    def _check(what: str, t: torch.Tensor) -> None:
        if not supports(t, reduce=False):
            raise ValueError(f"{what}: need a contiguous CPU tensor, got {t.dtype} on {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")

    def send(self, tensor: torch.Tensor) -> SendHandle:
        """Send `tensor` (contiguous, CPU, any dtype/shape) to `dst`, asynchronously
        (see [Note: asynchronous channel sends]); the tensor must not change
        until the handle's `wait()` returns.

        Raises:
            ValueError: not the sending rank, or not a contiguous CPU tensor.
            ShmChannelError: an earlier send on this channel failed.
        """
        self._usable(self.src, "send")
        self._check("ShmChannel.send", tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self._cond:
            if not self._queue:
                err = ctypes.create_string_buffer(_ERRLEN)
                rc = self._lib.dsrun_shm_chan_send(self._h, tensor.data_ptr(), nbytes, 0, err, _ERRLEN)
                if rc < 0:
                    self._error = err.value.decode()
                    raise ShmChannelError(f"rank {self.rank}: {self._error}")
                if rc == 1:
                    return SendHandle(None)
            handle = SendHandle(tensor)
            self._queue.append(handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name=f"dsrun-shm-send-{self.dst}-{self.tag}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return handle

    def _drain(self) -> None:
        """The sender thread: finishes the queued sends in order."""
        err = ctypes.create_string_buffer(_ERRLEN)
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                handle = self._queue[0]
            t = handle._tensor
            rc = self._lib.dsrun_shm_chan_send(self._h, t.data_ptr(), t.numel() * t.element_size(), 1, err, _ERRLEN)
            with self._cond:
                self._queue.popleft()
                if rc == 1:
                    handle._finish()
                    continue
                self._error = f"rank {self.rank}: {err.value.decode()}"
                for failed in (handle, *self._queue):
                    failed._finish(self._error)
                self._queue.clear()
                return

    def recv(self, tensor: torch.Tensor) -> torch.Tensor:
        """Receive the next message from `src` into `tensor` (contiguous CPU,
        exactly the message's bytes); blocks until it is there. Returns tensor.

        Raises:
            ValueError: not the receiving rank, or not a contiguous CPU tensor.
            ShmChannelError: the sender died or closed the channel, the wait
                ran past the timeout, or the message has another size (the
                channel is then closed: its stream cannot be trusted).
        """
        self._usable(self.dst, "recv")
        self._check("ShmChannel.recv", tensor)
        if self._h is None:
            self._h = self._open()
        err = ctypes.create_string_buffer(_ERRLEN)
        if self._lib.dsrun_shm_chan_recv(self._h, tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                         err, _ERRLEN) != 0:
            self._error = err.value.decode()
            self.close()
            raise ShmChannelError(f"rank {self.rank}: {self._error}")
        return tensor

    def close(self) -> None:
        """Close this end: sends still queued fail (wait on their handles
        first), the peer's waits fail instead of timing out, and the segment
        is freed when both ends are closed or gone."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if self._h and thread is not None and thread.is_alive():
            self._lib.dsrun_shm_chan_abort(self._h)
            thread.join()
        if self._h:
            self._lib.dsrun_shm_chan_close(self._h)
            self._h = None

    def __del__(self):
        if hasattr(self, "_cond"):  # __init__ got that far
            self.close()

"""Writing one rank's shard: the async I/O op, hashing while the disk writes,
and the copy-on-write snapshot behind `checkpoint.async_save`.

[Note: shard writing]
A shard is a safetensors file: the header, then each tensor's bytes in
order. The writer walks the file in windows of CHUNK_BYTES; for each window
it submits one asynchronous write per tensor (or piece of a tensor) in it
to dsrun's async I/O op (dsrun/ops/aio.py: O_DIRECT through io_uring or
libaio where the file system allows it, as DeepSpeed's FastPersist does, so
the bytes are not copied into the page cache), then feeds the same bytes to
the checksum (XXH3-128, see [Note: checkpoint checksums] in checksum.py)
while the device writes them (the hash releases the GIL), then waits for
the window. The hash costs no extra time as long as it keeps up with the
disk (at 20+ GB/s it does), and nothing is copied on the way: the source of
a write is the live tensor's memory (or a snapshot copy, below). Tensors
are stored in memory order, so that the slices of one flat buffer (a ZeRO
partition's masters, each of its Adam states) form one run of the file
written as one, and a window spans several runs: a ZeRO-3 shard holds a
slice of every bias and norm weight, and the writer still submits a few
writes and waits once per CHUNK_BYTES, not once per tensor; large runs
are aligned so that O_DIRECT takes them from memory as they are (see
[Note: aligned runs]). Without the native op the writes are plain pwrite
calls. The file is preallocated, goes to a temporary name, is fsynced and
renamed (see [Note: commit protocol] in store.py).

[Note: aligned runs]
O_DIRECT moves whole 4 KiB blocks between the device and memory: the
memory address and the file offset must both be multiples of 4096. The
async I/O op writes a request's unaligned head and tail (under 4 KiB each)
with plain pwrite and the aligned middle with O_DIRECT; when the middle's
memory address is not aligned too, every byte of it is first copied into a
bounce buffer. A tensor's address and its offset in a safetensors file are
unrelated, and the format allows no gaps between tensors, so the writer
makes them congruent modulo 4096: the header's JSON ends with spaces so that
the data starts at a multiple of 4096, and before each run of at least
ALIGNED_RUN_BYTES written from its own memory it stores a filler, a uint8
tensor of zeros under a key starting with FILLER_PREFIX, as long as needed
(at most 4095 bytes) to bring the run's file offset to its address modulo
4096. The middle of every such run then goes from the tensor's memory to
the device with no copy. Staged tensors need no filler: the staging buffer
is page-aligned and laid out like the file. Fillers are plain safetensors
tensors (any safetensors reader accepts the file) and have no entry in the
rank's description, so a load, an export or `dsrun-ckpt inspect` never
sees them; the checksum covers them like every other byte.

[Note: copy-on-write snapshot]
An asynchronous save must not write values that training has changed since
the call. Copying everything at the call (what a save to pinned memory does
on a GPU) makes the call as slow as a memcpy of the shard into fresh pages.
Instead the tensors that only an optimizer step changes (trainable values
and their optimizer states, on the CPU) are written in place, and every
other tensor (buffers, frozen parameters, RNG states, client tensors, any
tensor on an accelerator) is copied at the call into a staging buffer that
is reused from save to save (page-aligned; pinned when CUDA is available).
Before the next optimizer step the engine calls `release()`: it waits for
the window being written (at most CHUNK_BYTES) and copies whatever has not
been written yet into the staging buffer, and the writer continues from
there. When the write finishes before the next step, which is the common
case, nothing is copied at all. The staging buffer is laid out like the file
(a tensor at file offset o is staged at o), so a chunk's source is either
the tensor or the same range of the buffer, and aligned staged chunks go to
the disk with O_DIRECT without a bounce copy.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Any

import torch

from dsrun.ops.aio import PAGE, AioHandle, new_aligned_tensor
from dsrun.runtime.checkpoint import checksum
from dsrun.runtime.checkpoint.store import FileEntry, byte_view, follows, joined, safetensors_header

CHUNK_BYTES = 32 << 20
_FALLOCATE = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), "fallocate", None) \
    if os.name == "posix" else None  # Linux only
ALIGNED_RUN_BYTES = 64 << 10  # runs from this size on get a filler before them: see [Note: aligned runs]
FILLER_PREFIX = "__dsrun_filler__/"  # safetensors keys of fillers (uint8 zeros; no index entry)


class StagingBuffer:
    """A page-aligned host buffer reused by every save of one engine (pinned
    when CUDA is available); grows to the largest shard that needed it."""

    def __init__(self):
        self._buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of at least `nbytes` bytes (its contents are stale)."""
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # free the old one before allocating the larger one
            self._buf = new_aligned_tensor(nbytes)
        return self._buf


class _Part:
    """Bytes [offset, offset + nbytes) of the file: a tensor's or the header's."""

    __slots__ = ("offset", "data", "in_place", "written")

    def __init__(self, offset: int, data: torch.Tensor, in_place: bool):
        self.offset, self.data, self.in_place = offset, data, in_place
        self.written = 0  # bytes of this part already on disk


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's bytes (a contiguous copy first if needed)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserve the file's blocks up front (fallocate(2), as fio lays out its
    files) so that the direct writes do not allocate as they go; a file
    system without fallocate is left as it is (no zero-filling emulation)."""
    if _FALLOCATE is not None and nbytes:
        _FALLOCATE(fd, 0, ctypes.c_int64(0), ctypes.c_int64(nbytes))


class ShardWriter:
    """One shard file: `tensors` (key -> tensor, any shape/dtype/device)
    stored as safetensors with `metadata` in the header.

    in_place: keys whose tensors may be written from their own memory
    during an asynchronous save (changed only by an optimizer step); see
    [Note: copy-on-write snapshot]. All others are staged by `snapshot()`.
    """

    def __init__(self, path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                 in_place: set[str], aio: Any):
        self.path, self.aio = path, aio
        data = {key: _bytes_of(t) for key, t in tensors.items()}
        # In memory order: slices of one flat buffer (a ZeRO partition's
        # masters, its Adam states) become one run of the file, written as one.
        keys = sorted(data, key=lambda k: (data[k].device.type, data[k].data_ptr()))
        runs: list[tuple[list[str], torch.Tensor | None, bool]] = []  # (keys, their bytes, from own memory)
        for key in keys:
            t = data[key]
            own = key in in_place and t.device.type == "cpu"
            if runs and not t.numel():  # takes no bytes: anywhere in the file
                runs[-1][0].append(key)
            elif runs and runs[-1][2] == own and follows(runs[-1][1], t):
                runs[-1] = (runs[-1][0] + [key], joined(runs[-1][1], t), own)
            else:
                runs.append(([key], t if t.numel() else None, own))
        # See [Note: aligned runs]: a filler before each large run written from
        # its own memory makes its file offset congruent to its address.
        specs, sources, at = [], [], 0  # sources: (offset in the data section, bytes, own)
        for run_keys, t, own in runs:
            if own and t is not None and t.numel() >= ALIGNED_RUN_BYTES and (pad := (t.data_ptr() - at) % PAGE):
                specs.append((f"{FILLER_PREFIX}{len(specs)}", (pad,), torch.uint8))
                sources.append((at, torch.zeros(pad, dtype=torch.uint8), True))  # private: never changes
                at += pad
            specs += [(key, tuple(tensors[key].shape), tensors[key].dtype) for key in run_keys]
            if t is not None:
                sources.append((at, t, own))
                at += t.numel()
        header, _ = safetensors_header(specs, metadata, align=PAGE)
        self.size = len(header) + at
        head = new_aligned_tensor(len(header))  # page-aligned: O_DIRECT without a bounce copy
        head.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self.parts = [_Part(0, head, False)] + [_Part(len(header) + o, t, own) for o, t, own in sources]
        self._lock = threading.Lock()
        self._staging: torch.Tensor | None = None

    def _stage(self, part: _Part, staging: StagingBuffer) -> None:
        if self._staging is None:
            self._staging = staging.get(self.size)
        dst = self._staging[part.offset:part.offset + part.data.numel()]
        dst[part.written:].copy_(part.data[part.written:], non_blocking=part.data.device.type == "cuda")
        part.data, part.in_place = dst, False

    def snapshot(self, staging: StagingBuffer) -> None:
        """Stage every tensor that is not written in place (see [Note:
        copy-on-write snapshot]); returns when the copies are complete."""
        on_gpu = False
        for part in self.parts[1:]:
            if not part.in_place:
                on_gpu |= part.data.device.type == "cuda"
                self._stage(part, staging)
        if on_gpu:
            torch.cuda.synchronize()

    def release(self, staging: StagingBuffer) -> None:
        """Stop reading training memory: wait for the window being written and
        stage every in-place byte not written yet. Called before the state
        changes (an optimizer step); cheap once the write is done."""
        with self._lock:
            for part in self.parts:
                if part.in_place and part.written < part.data.numel():
                    self._stage(part, staging)
                part.in_place = False

    def write(self) -> FileEntry:
        """Write the file (temporary name, fsync, rename) and return its
        size and checksum. Raises OSError naming the file; the temporary file
        is removed on any error. See [Note: shard writing]."""
        tmp = os.path.join(os.path.dirname(self.path), f".{os.path.basename(self.path)}.tmp{os.getpid()}")
        digest = checksum.new()
        handle = AioHandle.from_config(self.aio)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _preallocate(fd, self.size)
            finally:
                os.close(fd)
            todo = list(self.parts)
            while todo:
                with self._lock:  # release() swaps part.data only between windows
                    window, room = [], CHUNK_BYTES
                    for part in todo:  # the next CHUNK_BYTES of the file, across parts
                        chunk = part.data[part.written:part.written + room]
                        handle.async_pwrite(chunk, tmp, part.offset + part.written)
                        window.append((part, chunk))
                        room -= chunk.numel()
                        if not room:
                            break
                    for _, chunk in window:
                        digest.update(byte_view(chunk))  # in file order, while the device writes
                    handle.wait()
                    for part, chunk in window:
                        part.written += chunk.numel()
                todo = [part for part in todo if part.written < part.data.numel()]
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        finally:
            handle.close()
        self.parts = []  # nothing of the state is referenced any more
        return FileEntry(algorithm=checksum.DEFAULT, checksum=digest.hexdigest(), bytes=self.size)

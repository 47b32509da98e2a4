"""Asynchronous file I/O for NVMe offload (csrc/aio/), with a PyTorch fallback.

    handle = AioHandle.from_config(cfg.aio)          # or AioHandle(block_size=..., ...)
    handle.pwrite(tensor, "/nvme/x.bin")              # synchronous
    handle.async_pread(tensor, "/nvme/x.bin"); ...; handle.wait()

Transfers use O_DIRECT (no page cache) through io_uring, or Linux native AIO
(engine "libaio": the kernel interface libaio wraps) where io_uring is
refused, in blocks of `block_size` bytes with `queue_depth` blocks in flight
on each of `intra_op_parallelism` threads. Both engines are built on the
kernel's UAPI headers with raw system calls (csrc/aio/), so the op needs
neither liburing-dev nor libaio-dev. Any size and
offset work: see [Note: O_DIRECT and unaligned sizes] in
csrc/aio/aio_handle.cpp. Tensors whose memory is not page-aligned go through
the handle's page-aligned bounce buffers; `new_aligned_tensor` gives memory
that needs none (pinned when CUDA is available, for fast copies to the GPU).

Errors are OSError with the errno, the file name and the offset in the
message; an async error is raised by `wait()`. Calls release the GIL.
"""
from __future__ import annotations

import ctypes
import errno as errno_mod
import logging
import os
from typing import Any

import torch

from dsrun.ops.builder import get_op

log = logging.getLogger("dsrun.ops")

ENGINES = ("io_uring", "libaio")
PAGE = 4096
MAX_BLOCK = 1 << 30  # csrc/aio/aio_engine.h kMaxBlock
_ERRLEN = 1024


def _native():
    lib = get_op("aio").load()
    if lib is not None and not hasattr(lib, "_dsrun_typed"):
        lib.dsrun_aio_create.restype = ctypes.c_void_p
        lib.dsrun_aio_create.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.dsrun_aio_destroy.argtypes = [ctypes.c_void_p]
        lib.dsrun_aio_submit.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int]
        lib.dsrun_aio_wait.restype = ctypes.c_int64
        lib.dsrun_aio_wait.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.dsrun_aio_direct_bytes.restype = ctypes.c_int64
        lib.dsrun_aio_direct_bytes.argtypes = [ctypes.c_void_p]
        lib._dsrun_typed = True
    return lib


def _os_error(code: int, message: str, path: str | os.PathLike) -> OSError:
    return OSError(code, f"{message or os.strerror(code)}", os.fspath(path))


def new_aligned_tensor(numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements whose memory starts on a page boundary.

    Pinned (page-locked) when CUDA is available, so copies to the GPU are
    asynchronous. O_DIRECT transfers use such memory without bounce buffers.
    """
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip: skip + nbytes].view(dtype)


class AioHandle:
    """Reads and writes whole tensors to files at a byte offset.

    Args:
        block_size: bytes per I/O request; a positive multiple of 4096, at most 1 GiB.
        queue_depth: requests in flight per thread.
        intra_op_parallelism: threads per read/write (`thread_count` is accepted too).
        single_submit: submit requests one at a time rather than in batches.
        overlap_events: submit new requests while others complete, rather
            than a batch at a time.
        engine: "auto" (io_uring, else libaio, else the Python fallback),
            "io_uring", "libaio" (Linux native AIO), or "python" (the fallback:
            buffered os.pread/pwrite). Naming an engine forces it: this is how
            each engine is tested on any machine.

    Raises:
        ValueError: bad sizes or an unknown engine.
        OSError: an engine named explicitly is refused by the kernel.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, intra_op_parallelism: int = 1,
                 single_submit: bool = False, overlap_events: bool = True, engine: str = "auto", *,
                 thread_count: int | None = None):
        if thread_count is not None:
            intra_op_parallelism = thread_count
        if not 0 < block_size <= MAX_BLOCK or block_size % PAGE or queue_depth <= 0 or intra_op_parallelism <= 0:
            raise ValueError(f"aio: block_size must be a positive multiple of {PAGE} up to {MAX_BLOCK} "
                             f"(got {block_size}); "
                             f"queue_depth ({queue_depth}) and intra_op_parallelism ({intra_op_parallelism}) "
                             "must be positive")
        if engine not in ("auto", "python", *ENGINES):
            raise ValueError(f"aio: engine must be auto, python, io_uring or libaio, got {engine!r}")
        self.block_size, self.queue_depth, self.threads = block_size, queue_depth, intra_op_parallelism
        self._handle = None
        self._pending: list[tuple[torch.Tensor, str]] = []  # keeps async buffers alive until wait()
        self._fallback_done = 0
        self.engine = "python"
        lib = _native() if engine != "python" else None
        if engine in ENGINES and lib is None:
            raise OSError(errno_mod.ENOSYS, f"aio engine {engine} unavailable: {get_op('aio').reason}")
        reasons = []
        for name in (ENGINES if engine == "auto" else (engine,) if engine in ENGINES else ()):
            if lib is None:
                break
            err = ctypes.create_string_buffer(_ERRLEN)
            h = lib.dsrun_aio_create(ENGINES.index(name), block_size, queue_depth, intra_op_parallelism,
                                     int(single_submit), int(overlap_events), err, _ERRLEN)
            if h:
                self._lib, self._handle, self.engine = lib, h, name
                break
            reasons.append(f"{name}: {err.value.decode()}")
        if engine in ENGINES and self._handle is None:
            raise OSError(errno_mod.ENOSYS, f"aio engine {engine} refused: {'; '.join(reasons)}")
        if engine == "auto" and self._handle is None and lib is not None:
            log.warning("dsrun.ops: aio: using the PyTorch fallback: %s", "; ".join(reasons))

    @classmethod
    def from_config(cls, aio: Any, engine: str = "auto") -> "AioHandle":
        """Build from the config's `aio` section (an AioConfig or a dict with DeepSpeed's keys)."""
        get = aio.get if isinstance(aio, dict) else lambda k, d=None: getattr(aio, k, d)
        threads = get("intra_op_parallelism", None) or get("thread_count", None) or 1
        return cls(block_size=get("block_size", 1 << 20), queue_depth=get("queue_depth", 8),
                   intra_op_parallelism=threads, single_submit=get("single_submit", False),
                   overlap_events=get("overlap_events", True), engine=engine)

    def close(self) -> None:
        """Free the threads and buffers (waits for pending requests first)."""
        if self._handle is not None:
            try:
                self.wait()
            finally:
                self._lib.dsrun_aio_destroy(self._handle)
                self._handle = None

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self._lib.dsrun_aio_destroy(self._handle)  # joins the worker threads

    def __enter__(self) -> "AioHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def direct_bytes(self) -> int:
        """Bytes the native engine moved with O_DIRECT (bypassing the page cache) since the
        handle was made; 0 for the Python fallback, and for files whose file system refuses
        O_DIRECT. The unaligned head and tail of a request (under 4 KiB each) are not counted."""
        return self._lib.dsrun_aio_direct_bytes(self._handle) if self._handle is not None else 0

    # -- requests ---------------------------------------------------------
    @staticmethod
    def _check(tensor: torch.Tensor, offset: int) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"aio: need a contiguous CPU tensor, got {tensor.device} "
                             f"{'contiguous' if tensor.is_contiguous() else 'non-contiguous'} {tuple(tensor.shape)}")
        if offset < 0:
            raise ValueError(f"aio: file offset must be >= 0, got {offset}")

    def _submit(self, write: bool, tensor: torch.Tensor, path, offset: int) -> None:
        self._check(tensor, offset)
        path = os.fspath(path)
        nbytes = tensor.numel() * tensor.element_size()
        if self._handle is None:
            self._python_io(write, tensor, path, offset, nbytes)
            self._fallback_done += 1
            return
        err = ctypes.create_string_buffer(_ERRLEN)
        rc = self._lib.dsrun_aio_submit(self._handle, int(write), tensor.data_ptr(), nbytes, path.encode(), offset,
                                        err, _ERRLEN)
        if rc != 0:
            raise _os_error(-rc, err.value.decode(), path)
        self._pending.append((tensor, path))

    @staticmethod
    def _python_io(write: bool, tensor: torch.Tensor, path: str, offset: int, nbytes: int) -> None:
        # The fallback: buffered pread/pwrite, same results and errors as the engines.
        what = "pwrite" if write else "pread"
        # A ctypes view of the tensor's bytes, not tensor.numpy(): NumPy is no install requirement.
        mv = memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())) if nbytes else memoryview(b"")
        fd = os.open(path, (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY, 0o644)
        done = 0
        try:
            size = os.fstat(fd).st_size
            if not write and nbytes and offset + nbytes > size:
                raise OSError(errno_mod.ENODATA, f"{what} {path}: read past end of file ({nbytes} bytes wanted, "
                                                 f"file has {size}) at offset {offset}", path)
            while done < nbytes:
                n = os.pwrite(fd, mv[done:], offset + done) if write else os.preadv(fd, [mv[done:]], offset + done)
                if n == 0:
                    raise OSError(errno_mod.EIO, f"{what} {path}: no progress at offset {offset + done}", path)
                done += n
        except OSError as e:
            if e.filename is not None:
                raise
            raise OSError(e.errno, f"{what} {path}: {e.strerror} (errno {e.errno}) at offset {offset + done}",
                          path) from None
        finally:
            os.close(fd)

    def async_pwrite(self, tensor: torch.Tensor, path, offset: int = 0) -> None:
        """Start writing the tensor's bytes to `path` at byte `offset` (file created if missing).
        Do not modify the tensor before `wait()`. Raises OSError at once if the file cannot be opened."""
        self._submit(True, tensor, path, offset)

    def async_pread(self, tensor: torch.Tensor, path, offset: int = 0) -> None:
        """Start filling the tensor from `path` at byte `offset`. Raises OSError at once if the
        file is missing or shorter than offset + the tensor's size (errno ENODATA)."""
        self._submit(False, tensor, path, offset)

    def wait(self) -> int:
        """Block (GIL released) until every started request finished; return how many.
        Raises OSError for the first that failed."""
        if self._handle is None:
            n, self._fallback_done = self._fallback_done, 0
            return n
        err = ctypes.create_string_buffer(_ERRLEN)
        rc = self._lib.dsrun_aio_wait(self._handle, err, _ERRLEN)
        paths = [p for _, p in self._pending]
        self._pending.clear()
        if rc < 0:
            msg = err.value.decode()  # "<pread|pwrite> <path>: <reason> (errno N) at offset X"
            path = next((p for p in paths if msg.startswith((f"pread {p}: ", f"pwrite {p}: "))), "")
            raise _os_error(-rc, msg, path)
        return rc

    def pwrite(self, tensor: torch.Tensor, path, offset: int = 0) -> int:
        """Write the tensor to `path` at `offset` and wait; returns the bytes written."""
        self.async_pwrite(tensor, path, offset)
        self.wait()
        return tensor.numel() * tensor.element_size()

    def pread(self, tensor: torch.Tensor, path, offset: int = 0) -> int:
        """Fill the tensor from `path` at `offset` and wait; returns the bytes read."""
        self.async_pread(tensor, path, offset)
        self.wait()
        return tensor.numel() * tensor.element_size()

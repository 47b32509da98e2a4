"""Reading element ranges of global tensors from a tag's shards, checking each
file's checksum on the way.

[Note: verified reads]
A load must never use corrupted bytes silently, and hashing every file in a
pass of its own before reading it (what earlier dsrun did) reads every byte
twice. `SliceReader.read_many` takes all the ranges a load needs at once,
turns them into byte ranges of each file (from the shard's safetensors
header), and reads each file once, in file order, in windows of
WINDOW_BYTES into a page-aligned scratch buffer through the async I/O op
(O_DIRECT where the file system allows it; window starts are multiples of
4096, so no request has an unaligned head, which would be a synchronous
read of its own). While the next window is being read (two handles, two
scratch buffers), the finished one is fed to the checksum and the wanted
bytes in it are copied to their destinations (casting when the dtype
differs). A reader that verifies the file reads all of it (header, fillers,
slices other ranks need); otherwise only the wanted ranges, widened to 4 KiB
and merged when less than GAP_BYTES apart. The digest is compared when the
file is done: a mismatch raises CheckpointError naming the file before the
load returns, so values that were read are never used (the load fails on
every rank: see [Note: commit protocol] in store.py). Which files a reader
verifies is the caller's choice: a single process verifies every file it
opens; the ranks of a load share the files (file i is verified by rank
i mod world size, reading it whole even if it needs nothing from it, see
`verify_rest`), and the load's agreement makes every rank fail, with the
file's name, when one found a bad file. Sizes are checked by every reader
on every file it opens, so a truncated file is named at once.
"""
from __future__ import annotations

import bisect
import itertools
import json
import os
import struct
from typing import Any

import torch

from dsrun.ops.aio import PAGE, AioHandle, new_aligned_tensor
from dsrun.runtime.checkpoint import checksum
from dsrun.runtime.checkpoint.store import CheckpointError, Index, byte_view, dtype_of, safetensors_dtype

WINDOW_BYTES = 32 << 20  # a multiple of 4096
GAP_BYTES = 1 << 20  # ranges closer than this are read as one (the gap read and dropped)


class SliceReader:
    """Reads element ranges of global tensors from a tag's shards.

    verify: check checksums at all (False: sizes only).
    verify_files: the files this reader checks (default: every file it
        opens); each is read whole once, the first time it is read from,
        or by `verify_rest`. See [Note: verified reads].
    aio: the config's `aio` section (block size, queue depth, threads).
    Raises CheckpointError naming the file on a missing, truncated,
    unreadable or corrupted shard.
    """

    def __init__(self, tag_dir: str, index: Index, verify: bool = True, verify_files: set[str] | None = None,
                 aio: Any = None):
        self.tag_dir, self.index = tag_dir, index
        self._verify_files = (set(index.files) if verify_files is None else set(verify_files)) if verify else set()
        self._aio = aio if aio is not None else {}
        self._headers: dict[str, tuple[int, dict[str, Any], int]] = {}  # file -> (data start, header, size)
        self._verified: set[str] = set()
        self._scratch: list[torch.Tensor] = []

    def _path(self, file: str) -> str:
        return os.path.join(self.tag_dir, file)

    def _header(self, file: str) -> tuple[int, dict[str, Any], int]:
        """(where the data section starts, the parsed safetensors header, the
        file's size); checks the file's presence and size first."""
        if file not in self._headers:
            path = self._path(file)
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint file {path} is missing")
            size, entry = os.path.getsize(path), self.index.files.get(file)
            if entry is not None and size != entry.bytes:
                raise CheckpointError(f"checkpoint file {path} is truncated or altered: {size} bytes, "
                                      f"the index recorded {entry.bytes}")
            try:
                with open(path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    if n > size - 8:
                        raise ValueError(f"header length {n} exceeds the file")
                    header = json.loads(f.read(n))
            except (ValueError, struct.error, UnicodeDecodeError) as e:
                raise CheckpointError(f"checkpoint file {path} cannot be read: not a safetensors file ({e})") \
                    from None
            self._headers[file] = (8 + n, header, size)
        return self._headers[file]

    def _segments(self, name: str, lo: int, hi: int, out: torch.Tensor, segs: dict, casts: list) -> None:
        """Add the byte ranges holding elements [lo, hi) of `name` to `segs`
        (file -> [(start, dest uint8 view)]); a destination of another dtype
        gets a temporary, copied into it by `read_many` (`casts`)."""
        entry = self.index.tensors[name]
        covered = 0
        for s in entry.slices:
            a, b = max(lo, s.lo), min(hi, s.hi)
            if a >= b:
                continue
            start, header, file_size = self._header(s.file)
            rec = header.get(s.key)
            dtype = safetensors_dtype(rec["dtype"]) if isinstance(rec, dict) else None
            size = torch.empty((), dtype=dtype).element_size() if dtype is not None else 0
            if (dtype is None or rec["data_offsets"][1] - rec["data_offsets"][0] != (s.hi - s.lo) * size
                    or start + rec["data_offsets"][1] > file_size):
                raise CheckpointError(f"checkpoint file {self._path(s.file)}: tensor {s.key!r} is missing or does "
                                      f"not hold elements [{s.lo}, {s.hi}) of {name!r} as the index says")
            dst = out[a - lo:b - lo]
            if dst.dtype != dtype or dst.device.type != "cpu" or not dst.is_contiguous():
                tmp = torch.empty(b - a, dtype=dtype)
                casts.append((dst, tmp))
                dst = tmp
            first = start + rec["data_offsets"][0] + (a - s.lo) * size
            segs.setdefault(s.file, []).append((first, dst.reshape(-1).view(torch.uint8)))
            covered += b - a
        if covered != hi - lo:
            raise CheckpointError(f"checkpoint tensor {name!r} stores {covered} of elements [{lo}, {hi}) "
                                  "(the index's slices do not cover it)")

    def read_many(self, requests: list[tuple[str, int, int, torch.Tensor]]) -> None:
        """For each (name, lo, hi, out): copy elements [lo, hi) of global
        tensor `name` into 1-D `out` (hi - lo,), casting to its dtype. Reads
        each file once (see [Note: verified reads]). Raises CheckpointError."""
        segs: dict[str, list[tuple[int, torch.Tensor]]] = {}
        casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, lo, hi, out in requests:
            self._segments(name, lo, hi, out, segs, casts)
        for file in sorted(segs):
            self._read_file(file, segs[file])
        for dst, tmp in casts:
            dst.copy_(tmp)

    def verify_rest(self) -> None:
        """Check every file this reader verifies that no read has covered
        yet (reading it whole). Raises CheckpointError naming a bad file."""
        for file in sorted(self._verify_files - self._verified):
            self._header(file)
            self._read_file(file, [])

    def _read_file(self, file: str, wanted: list[tuple[int, torch.Tensor]]) -> None:
        path = self._path(file)
        hashing = file in self._verify_files and file not in self._verified
        entry = self.index.files.get(file)
        size = os.path.getsize(path)
        wanted = sorted((w for w in wanted if w[1].numel()), key=lambda w: w[0])
        reach = list(itertools.accumulate((at + dest.numel() for at, dest in wanted), max))  # ends so far
        digest = checksum.new(entry.algorithm) if hashing and entry is not None else None
        handles = [AioHandle.from_config(self._aio) for _ in range(2)]
        try:
            previous = None  # the window in flight on the other handle
            for w, (start, end) in enumerate(_windows(_spans(wanted, size, hashing))):
                slot = w % 2
                while len(self._scratch) <= slot:
                    self._scratch.append(new_aligned_tensor(WINDOW_BYTES))
                window = self._scratch[slot][:end - start]
                try:
                    handles[slot].async_pread(window, path, start)
                except OSError as e:
                    raise CheckpointError(f"checkpoint file {path} cannot be read: {e}") from None
                if previous is not None:
                    self._finish(handles[1 - slot], *previous, wanted, reach, digest, path)
                previous = (start, window)
            if previous is not None:
                self._finish(handles[w % 2], *previous, wanted, reach, digest, path)
        finally:
            for h in handles:
                h.close()
        if digest is not None and digest.hexdigest() != entry.checksum:
            raise CheckpointError(f"checkpoint file {path} is corrupted: its {entry.algorithm} checksum does not "
                                  "match the index")
        if hashing:
            self._verified.add(file)

    @staticmethod
    def _finish(handle: AioHandle, start: int, window: torch.Tensor, wanted, reach, digest, path: str) -> None:
        """Wait for a window of the file; hash it; copy the wanted bytes in it
        to their destinations (`wanted` sorted by start; `reach[i]`: the
        largest end among wanted[:i + 1])."""
        try:
            handle.wait()
        except OSError as e:
            raise CheckpointError(f"checkpoint file {path} cannot be read: {e}") from None
        if digest is not None:
            digest.update(byte_view(window))
        end = start + window.numel()
        i = bisect.bisect_right(reach, start)  # every range before i ends at or before the window
        for at, dest in wanted[i:]:
            if at >= end:
                break
            a, b = max(at, start), min(at + dest.numel(), end)
            if a < b:  # (a range inside an earlier, longer one may end before the window)
                dest[a - at:b - at].copy_(window[a - start:b - start])

    def read_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy elements [lo, hi) of global tensor `name` into 1-D `out`
        (hi - lo,), casting to its dtype. Raises CheckpointError when the
        stored slices do not cover [lo, hi) or a file is bad."""
        self.read_many([(name, lo, hi, out)])

    def read_full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole global tensor `name` with its shape (stored dtype unless `dtype`)."""
        entry = self.index.tensors[name]
        numel = 1
        for d in entry.shape:
            numel *= d
        out = torch.empty(numel, dtype=dtype or dtype_of(entry.dtype))
        self.read_into(name, 0, numel, out)
        return out.view(entry.shape)


def _spans(wanted: list[tuple[int, torch.Tensor]], size: int, whole: bool) -> list[tuple[int, int]]:
    """The byte ranges of a file to read: all of it (`whole`), else the
    wanted ranges widened to 4 KiB boundaries (O_DIRECT reads them with no
    unaligned head), those less than GAP_BYTES apart merged."""
    if whole:
        return [(0, size)] if size else []
    spans: list[tuple[int, int]] = []
    for at, dest in wanted:
        lo, hi = at - at % PAGE, min(size, -(-(at + dest.numel()) // PAGE) * PAGE)
        if spans and lo - spans[-1][1] < GAP_BYTES:
            spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
        else:
            spans.append((lo, hi))
    return spans


def _windows(spans: list[tuple[int, int]]):
    """The spans cut into windows of at most WINDOW_BYTES (a multiple of 4096)."""
    for lo, hi in spans:
        for start in range(lo, hi, WINDOW_BYTES):
            yield start, min(hi, start + WINDOW_BYTES)

"""Where stage 3's compute partitions live: with the model, in host memory, or on NVMe.

[Note: parameter tiers]
At stage 3 each gather unit's FlatParamSet keeps this rank's compute-dtype
shards in `fset.partition`. A `ParamTier` decides where that partition is:

- `ParamTier(host=False)`: no offload, always resident with the model.
- `ParamTier(host=True)`: `offload_param.device: cpu`. The partition is
  allocated in host memory (page-locked on a CUDA machine) and the unit's
  gather copies this rank's shards from there into the gathered buffer on
  the device. On a CPU-only machine host memory is the device memory, so
  this changes nothing but where the code says the partition lives.
- `NvmeParamTier`: `offload_param.device: nvme` (ZeRO-Infinity, Rajbhandari
  et al., SC21, section 5.1). Partitions live in this rank's swap file
  `params.swp`; a partition's storage is resized to zero bytes while it is
  not needed (like a released unit, see [Note: unit storage] in unit.py) and
  read back when it is: by a unit's gather (read, then freed again), by the
  optimizer step (read only when the partition is the fp32 master; the
  updated trainable region is written back and the storage freed), and by
  checkpoints and full-tensor reads (`materialize`, until `settle`). The
  gather schedule prefetches: when unit trace[i] is fetched, the partitions
  of the next `buffer_count` units of the recorded trace (see [Note: the
  fetch trace] in zero/schedule.py) are read asynchronously, so the read is
  done when the unit's all-gather is issued. Prefetched partitions are
  1/N of a unit each; the gathered units stay within
  stage3_max_live_parameters as before.

Resident partitions are reference counted: `resident(fset)` is a context
manager, nested uses share one read.

[Note: gathering from host memory]
An offloaded partition is in host memory (page-locked with pin_memory, and
always for NVMe, whose reads land there) while the unit's gathered buffer
is on the compute device. A unit's gather runs its own-shard copies and
issues its all-gather inside `uploading(fset)`: on a CUDA device that is
the offload copy stream (transfer.py, `CopyStream`), which first waits for
the work already queued on the compute stream; the copies are
non-blocking, so a prefetched unit's copy overlaps the layers computing
meanwhile, and the all-gather's stream waits for the copy stream, not for
compute. `Unit.wait` then makes the compute stream wait (on the device)
for the copy's event: compute waits only for the unit it is about to use.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field

import torch

from dsrun.ops.aio import AioHandle
from dsrun.runtime.offload.swap import SwapDir
from dsrun.runtime.offload.transfer import CopyStream


class ParamTier:
    """Partitions with the model (host=False) or in host memory (host=True);
    see [Note: parameter tiers] and [Note: gathering from host memory].

    Args:
        host: keep partitions in host memory (offload_param.device cpu).
        pin_memory: page-lock them (on a machine with CUDA).
        offload_device: the host memory's device ("cpu"; tests name another
            one to see which tensors follow it).
    """

    lookahead = 0  # partitions the schedule may prefetch ahead

    def __init__(self, host: bool = False, pin_memory: bool = False, offload_device: str | torch.device = "cpu"):
        self.host = host
        self.pin_memory = pin_memory
        self.offload_device = torch.device(offload_device)
        self.device_kind = "cpu" if host else "none"  # offload_param.device
        self._copies: CopyStream | None = None
        self.h2d_bytes = 0  # cumulative bytes copied from offloaded partitions to the device

    def partition_device(self, device: torch.device) -> torch.device:
        """Where a FlatParamSet on `device` keeps its compute partition."""
        return self.offload_device if self.host else torch.device(device)

    @contextlib.contextmanager
    def uploading(self, fset):
        """A unit's own-shard copies from `fset.partition` and its all-gather
        are issued inside. Yields the CUDA event that completes after them
        when they run on the copy stream (partition in host memory, unit on
        CUDA), else None; pass it to `wait_uploaded`. See [Note: gathering
        from host memory]."""
        device = fset.compute_device
        if fset.partition.device == device or device.type != "cuda":
            yield None
            return
        if self._copies is None or self._copies.device != device:
            self._copies = CopyStream(device)
        side = self._copies.stream
        side.wait_stream(torch.cuda.current_stream(device))  # `full`'s memory is free, the partition final
        done = torch.cuda.Event()
        with torch.cuda.stream(side):
            yield done
            done.record()
        self.h2d_bytes += fset.partition.numel() * fset.partition.element_size()

    @staticmethod
    def wait_uploaded(done) -> None:
        """The compute stream waits (on the device, the host does not block)
        for the copies of `uploading` that yielded `done` (None: nothing to wait for)."""
        if done is not None:
            torch.cuda.current_stream().wait_event(done)

    def prepare(self, strategy, param_numels: list[int], world_size: int) -> None:
        """Before any set exists: full element counts of every partitioned parameter."""

    def adopt(self, fset) -> None:
        """A set was built; its partition holds the initial values."""

    @contextlib.contextmanager
    def resident(self, fset, write: bool = False):
        """`fset.partition` holds its values inside the block (written back
        afterwards when `write`)."""
        yield

    @contextlib.contextmanager
    def stepping(self):
        """For the optimizer step: a function `enter(fset)` that makes
        fset's partition resident (writing back the previous set's)."""
        yield lambda fset: None

    def prefetch(self, fset) -> None:
        """Start reading fset's partition (asynchronously) if it is offloaded."""

    def materialize(self, strategy) -> None:
        """Every partition resident (checkpoints, full-tensor reads)."""

    def settle(self, strategy) -> None:
        """Undo `materialize`, writing back."""

    def nvme_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


@dataclass
class _Slot:
    offset: int                  # element offset in params.swp
    refs: int = 0
    resident: bool = False
    pending: AioHandle | None = field(default=None, repr=False)  # a prefetch in flight


class NvmeParamTier(ParamTier):
    """Partitions in this rank's `params.swp` under `nvme_path`; see [Note: parameter tiers].

    Args:
        nvme_path: the directory (checked, see swap.py).
        rank: this rank.
        buffer_count: partitions read ahead of their unit's gather.
        aio: the config's `aio` section.
    Raises (at `prepare`): SwapError for an unusable nvme_path.
    """

    def __init__(self, nvme_path, rank: int, buffer_count: int, aio):
        super().__init__(host=True, pin_memory=True)  # reads land in page-locked memory: copied to the device
        self.device_kind = "nvme"
        self.nvme_path, self.rank, self.aio = nvme_path, rank, aio
        self.lookahead = max(1, int(buffer_count))
        self.swap: SwapDir | None = None
        self._slots: dict[int, _Slot] = {}
        self._sets: list = []
        self._next = 0
        self._capacity = 0
        self._elt = 2
        self._handle_: AioHandle | None = None
        self._pool: list[AioHandle] = []  # handles free for prefetches (lookahead of them)
        self._made = 0
        self._materialized = False
        self.stats = {"read_bytes": 0, "write_bytes": 0, "io_wait_s": 0.0}  # cumulative

    def prepare(self, strategy, param_numels: list[int], world_size: int) -> None:
        self._elt = torch.empty((), dtype=strategy.precision.compute_dtype).element_size()
        self._capacity = sum(-(-n // world_size) + 1 for n in param_numels)
        self.swap = SwapDir.create(self.nvme_path, self.rank, {"params": self._capacity * self._elt},
                                   "offload_param.nvme_path", "params")
        weakref.finalize(self, self.swap.remove)

    def _handle(self) -> AioHandle:
        if self._handle_ is None:
            self._handle_ = AioHandle.from_config(self.aio, engine="auto" if self.swap.o_direct else "python")
        return self._handle_

    def _io(self, handle: AioHandle, write: bool, t: torch.Tensor, offset: int, wait: bool = True) -> None:
        t0 = time.perf_counter()
        try:
            (handle.async_pwrite if write else handle.async_pread)(t, self.swap.files["params"], offset * self._elt)
            if wait:
                handle.wait()
        except OSError as e:
            raise self.swap.check("params", e) from None
        self.stats["write_bytes" if write else "read_bytes"] += t.numel() * self._elt
        self.stats["io_wait_s"] += time.perf_counter() - t0

    def adopt(self, fset) -> None:
        numel = fset.partition.numel()
        slot = _Slot(self._next)
        self._next += numel
        if self._next > self._capacity:  # the bound in prepare() is wrong: a bug, not bad input
            raise RuntimeError(f"NVMe parameter tier: {self._next} elements exceed the reserved {self._capacity}")
        self._slots[id(fset)] = slot
        self._sets.append(fset)
        self._io(self._handle(), True, fset.partition, slot.offset)
        fset.partition.untyped_storage().resize_(0)  # lives in params.swp from now on

    # ---- residency -------------------------------------------------------------------------
    def _acquire(self, fset, read: bool = True) -> None:
        slot = self._slots[id(fset)]
        if slot.pending is not None:
            t0 = time.perf_counter()
            try:
                slot.pending.wait()
            except OSError as e:
                raise self.swap.check("params", e) from None
            finally:
                self._pool.append(slot.pending)
                slot.pending = None
                self.stats["io_wait_s"] += time.perf_counter() - t0
        elif not slot.resident:
            part = fset.partition
            part.untyped_storage().resize_(part.numel() * self._elt)
            if read:
                self._io(self._handle(), False, part, slot.offset)
        slot.resident = True
        slot.refs += 1

    def _release(self, fset, write: bool) -> None:
        slot = self._slots[id(fset)]
        slot.refs -= 1
        if write and fset.trainable_shard_numel:
            self._io(self._handle(), True, fset.partition[:fset.trainable_shard_numel], slot.offset)
        if slot.refs == 0:
            fset.partition.untyped_storage().resize_(0)
            slot.resident = False

    @contextlib.contextmanager
    def resident(self, fset, write: bool = False):
        self._acquire(fset)
        try:
            yield
        finally:
            self._release(fset, write)

    @contextlib.contextmanager
    def stepping(self):
        current = []

        def enter(fset):
            if current and current[0] is fset:
                return
            if current:
                self._release(current.pop(), write=True)
            # A 16-bit partition is overwritten by the step: no need to read it first.
            self._acquire(fset, read=not fset.separate_master)
            current.append(fset)
        try:
            yield enter
        finally:
            if current:
                self._release(current.pop(), write=True)

    def prefetch(self, fset) -> None:
        slot = self._slots[id(fset)]
        if slot.resident or slot.pending is not None:
            return
        if not self._pool and self._made < self.lookahead:
            self._pool.append(AioHandle.from_config(self.aio, engine="auto" if self.swap.o_direct else "python"))
            self._made += 1
        if not self._pool:
            return  # lookahead partitions already in flight
        part = fset.partition
        part.untyped_storage().resize_(part.numel() * self._elt)
        slot.pending = self._pool.pop()
        self._io(slot.pending, False, part, slot.offset, wait=False)

    def materialize(self, strategy) -> None:
        if not self._materialized:
            for fset in self._sets:
                self._acquire(fset)
            self._materialized = True

    def settle(self, strategy) -> None:
        if self._materialized:
            self._materialized = False
            for fset in self._sets:
                slot = self._slots[id(fset)]
                self._io(self._handle(), True, fset.partition, slot.offset)
                self._release(fset, write=False)

    def nvme_bytes(self) -> int:
        return self.swap.total_bytes() if self.swap is not None else 0

    def close(self) -> None:
        for h in self._pool + ([self._handle_] if self._handle_ is not None else []):
            h.close()
        if self.swap is not None:
            self.swap.remove()

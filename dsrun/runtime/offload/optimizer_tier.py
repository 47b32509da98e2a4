"""Where a ZeRO strategy's fp32 master weights and Adam moments live, and the step over them.

[Note: optimizer tiers]
Every ZeRO strategy holds one `OptimizerTier` and calls it for the
optimizer step; the strategy never tests an offload flag.

- `OptimizerTier(host=False)`: no offload. Masters and moments live with the
  parameters; the step runs where they are (dsrun's CPU Adam, or the CUDA
  multi-tensor Adam on a GPU).
- `OptimizerTier(host=True)`: `offload_optimizer.device: cpu` (ZeRO-Offload,
  Ren et al., USENIX ATC 2021, section 4). Masters and moments live in host
  memory (page-locked with pin_memory). With the model on an accelerator,
  the averaged gradients of stages 2-3 live in host memory too and reach it
  during backward, and dsrun's CPU Adam writes the 16-bit values into
  page-locked buffers that go back to the device while it updates the next
  chunk: see [Note: offload copies] in transfer.py. Stage 1 keeps its full
  gradient buffer on the device; the step copies each sub-group's shard to
  the host. On a CPU-only machine host and device memory are the same, so
  nothing is copied: the arithmetic and the results are those of no
  offload, bit for bit.
- `NvmeOptimizerTier`: `offload_optimizer.device: nvme` (ZeRO-Infinity,
  Rajbhandari et al., SC21, section 5). Masters (when separate from the
  compute copy) and moments live in this rank's swap files (see swap.py);
  only `buffer_count` sub-group buffers are in memory. See [Note: streamed
  step].

[Note: streamed step]
The trainable partition is cut into sub-groups of at most `sub_group_size`
elements (never across a span). Sub-group k's master and moments are read
into buffer k % B (B = buffer_count); while the CPU Adam updates k, the read
of k + 1 and the write of k - 1 are in flight (each buffer has its own aio
handle, so waiting for one transfer never waits for another). With B >= 3
reads, compute and writes all overlap; B = 2 serialises the write of k - 1
before the read of k + 1; B = 1 does no overlap. The arithmetic per element
is the in-memory step's, so losses equal no offload bit for bit. Host
memory: B x 3 x 4 bytes x sub-group elements, plus one gradient staging
buffer on a CUDA machine.

`offload_optimizer.ratio` < 1 (ZeRO-Offload++'s "twin flow") keeps the
first (1 - ratio) of the sub-group elements in memory for good: they are
updated without any I/O before the streamed ones.

Code that reads or writes masters and moments outside the step (checkpoints,
`safe_get_full_*`, GatheredParameters) calls `materialize`, which reads them
into ordinary tensors where the in-memory tier keeps them (`fset.master`,
`optimizer.state[key]`); the next step (or `settle`) writes them back and
frees them. A checkpoint of an NVMe-offloaded run therefore needs this
rank's partition of masters and moments in host memory for its duration.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

from dsrun.ops import adam as native_adam
from dsrun.ops import cuda_adam
from dsrun.ops.aio import AioHandle, new_aligned_tensor
from dsrun.runtime.offload.swap import SwapDir
from dsrun.runtime.offload.transfer import (
    PIPELINE_NUMEL,
    CopyStream,
    HostGradients,
    OffloadTimeline,
    Uploader,
)

log = logging.getLogger("dsrun.offload")
_HALF = (torch.bfloat16, torch.float16)


def _chunks(n: int, size: int):
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)


class OptimizerTier:
    """Masters and optimizer states in memory: with the parameters (host=False)
    or in host memory (host=True). See [Note: optimizer tiers].

    Args:
        host: keep masters and states in host memory (optimizer offload to cpu).
        pin_memory: page-lock them (only matters on a CUDA machine).
        sub_group_size: most elements the fused CPU Adam processes at once.
        force_native: with host=True, refuse an optimizer other than dsrun's
            Adam (ds_config's zero_force_ds_cpu_optimizer, as in DeepSpeed).
        offload_device: the host memory's device ("cpu"; tests name another
            one to see which tensors follow it).

    Attributes:
        timeline: the OffloadTimeline of the copies, host gradient work and
            CPU Adam of the last step (see transfer.py).
        host_grads: the HostGradients moving gradients to host memory during
            backward, or None (no optimizer offload, a CPU model, stage 1).
    """

    def __init__(self, host: bool = False, pin_memory: bool = False, sub_group_size: int = 1_000_000_000,
                 force_native: bool = True, offload_device: str | torch.device = "cpu"):
        self.host = host
        self.force_native = force_native
        self.pin_memory = pin_memory
        self.sub_group_size = int(sub_group_size)
        self.offload_device = torch.device(offload_device)
        self._staging: dict[str, torch.Tensor] = {}
        self.stats: dict[str, float] = {}
        self.device_kind = "cpu" if host else "none"  # offload_optimizer.device
        self.timeline = OffloadTimeline()
        self.host_grads: HostGradients | None = None
        self.uploads: Uploader | None = None

    # ---- construction -----------------------------------------------------------------
    def master_device(self, device: torch.device) -> torch.device:
        """Where a FlatParamSet on `device` keeps its master."""
        return self.offload_device if self.host else torch.device(device)

    def grad_device(self, device: torch.device) -> torch.device:
        """Where a stage-2/3 FlatParamSet on `device` keeps its averaged
        gradients: host memory when the optimizer is offloaded from another
        device, else with the parameters."""
        return self.offload_device if self.host and torch.device(device) != self.offload_device \
            else torch.device(device)

    def prepare(self, strategy, param_numels: list[int], world_size: int) -> None:
        """Before any FlatParamSet exists: the full element counts of the
        trainable parameters (NVMe reserves its files from them). Raises
        ValueError for an optimizer the tier cannot step."""
        if self.host and self.force_native and not strategy.fused:
            raise ValueError(f"offload_optimizer.device {self.device_kind} with a client optimizer "
                             f"({type(strategy.optimizer).__name__}): set \"optimizer\" in ds_config (Adam/AdamW "
                             "run dsrun's CPU Adam) or pass dsrun.ops.adam.DeepSpeedCPUAdam, or set "
                             "zero_force_ds_cpu_optimizer to false to step it with torch (slower)")

    def adopt(self, strategy, fset) -> None:
        """A FlatParamSet was just built (its master holds the initial values)."""

    def bind(self, strategy) -> None:
        """Every set is built and the optimizer bound to its master views:
        with masters in host memory and the model on another device, set up
        the copies of [Note: offload copies] (before the strategy builds its
        reducer, which sends gradients through `host_grads`)."""
        if not self.host or not strategy.sets:
            return
        device = strategy.sets[0].compute_device
        if device == self.offload_device:
            return  # a CPU model: host memory is the device memory
        copies = CopyStream(device, self.timeline)
        self.uploads = Uploader(copies, self.timeline)
        if any(f.grads_offloaded for f in strategy.sets):
            self.host_grads = HostGradients(copies, self.timeline)

    def close(self) -> None:
        """Release files, buffers and the gradient worker thread."""
        if self.host_grads is not None:
            self.host_grads.close()

    # ---- the step -----------------------------------------------------------------------
    def step(self, strategy, factor: float) -> None:
        """Apply the optimizer to every span with gradients multiplied by `factor`
        (call `settle` first). Returns once the new compute values are where
        the next forward reads them."""
        self.timeline.begin(strategy.topology.device)
        if strategy.fused:
            self._fused_step(strategy, factor)
        else:
            self._torch_step(strategy, factor)
        if self.uploads is not None:
            self.uploads.finish()
        self.timeline.end()

    @staticmethod
    def adam_state(optimizer: torch.optim.Optimizer, key: torch.Tensor, like: torch.Tensor | None = None) -> dict:
        """optimizer.state[key], created as torch's Adam creates it (fp32 moments like `like`)."""
        state = optimizer.state[key]
        if not state:
            like = key if like is None else like
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(like, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(like, dtype=torch.float32)
        return state

    def _fused_step(self, s, factor: float) -> None:
        """See [Note: fused step] in zero/strategy.py."""
        with s.param_tier.stepping() as resident:
            for fset, span, master in s.master_views:
                resident(fset)
                self._fused_span(s, fset, span, master, factor)
                s.span_stepped(fset, span)  # stages 1-2 start gathering it (see stage12.py)

    def _fused_span(self, s, fset, span, master, factor: float) -> None:
        state = self.adam_state(s.optimizer, master)
        state["step"] += 1
        args = native_adam.adam_hyperparams(s.optimizer.param_groups[span.group], s.optimizer)
        args.update(step=int(state["step"].item()), grad_scale=factor)
        grad, copy = fset.grad_view(span), fset.copy_view(span)
        if master.device.type == "cuda":
            cuda_adam.multi_tensor_adam([master], [grad if grad.dtype == master.dtype else grad.float()],
                                        [state["exp_avg"]], [state["exp_avg_sq"]], **args)
            if copy is not None:
                copy.copy_(master)
            return
        for lo, hi in _chunks(master.numel(), self.sub_group_size):
            self._cpu_adam(master[lo:hi], grad[lo:hi], state["exp_avg"][lo:hi], state["exp_avg_sq"][lo:hi],
                           None if copy is None else copy[lo:hi], args)
        if self.uploads is not None:
            self.uploads.copies.join()  # what the stage gathers next (span_stepped) waits for the copies

    def _cpu_adam(self, master, grad, exp_avg, exp_avg_sq, copy, args: dict) -> None:
        """dsrun's CPU Adam on host tensors; `grad` and `copy` may be on the
        device. A compute copy on the device is written through the uploader
        in chunks of PIPELINE_NUMEL (see [Note: offload copies])."""
        grad = self._on_host(grad, "grad")
        if copy is None or copy.device.type == "cpu" or self.uploads is None:
            direct = copy is not None and copy.device.type == "cpu" and copy.dtype in _HALF
            t0 = time.perf_counter()
            native_adam.adam_step(master, grad, exp_avg, exp_avg_sq, param_copy=copy if direct else None, **args)
            if copy is not None and not direct:
                copy.copy_(master)  # an fp32 compute copy elsewhere
            self.timeline.cpu("adam", t0, time.perf_counter())
            return
        half = copy.dtype in _HALF
        for lo, hi in _chunks(master.numel(), PIPELINE_NUMEL):
            buf = self.uploads.buffer(hi - lo, copy.dtype)  # free once its previous copy is done
            t0 = time.perf_counter()
            native_adam.adam_step(master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                                  param_copy=buf if half else None, **args)
            if not half:
                buf.copy_(master[lo:hi])
            self.timeline.cpu("adam", t0, time.perf_counter())
            self.uploads.send(buf, copy[lo:hi])  # overlaps the next chunk's update

    def _on_host(self, t: torch.Tensor, slot: str) -> torch.Tensor:
        """`t` itself when in host memory, else a copy in a reused host staging buffer."""
        if t.device.type == "cpu":
            return t
        buf = self._staging.get(slot)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=self.pin_memory and torch.cuda.is_available())
            self._staging[slot] = buf
        out = buf[:t.numel()]
        out.copy_(t)
        return out

    def _torch_step(self, s, factor: float) -> None:
        """Any torch optimizer: scaled gradient shards as the masters' .grad."""
        for fset, span, master in s.master_views:
            grad = fset.grad_view(span)
            if factor != 1.0:
                grad.mul_(factor)  # in place: the buffer is zeroed after the step anyway
            master.grad = grad.to(master.device, master.dtype)  # no copy when both match
        s.param_tier.materialize(s)  # every compute partition resident for the write-back
        s.optimizer.step()
        for fset, span, master in s.master_views:
            master.grad = None
        for fset in s.sets:
            fset.write_back_master()
        s.param_tier.settle(s)

    # ---- access outside the step --------------------------------------------------------
    def materialize(self, strategy) -> None:
        """Make masters and states ordinary tensors (fset.master, optimizer.state)."""

    def settle(self, strategy) -> None:
        """Undo `materialize` (writing back what it read)."""

    def held(self, strategy) -> dict[str, list[torch.Tensor]]:
        """Extra host tensors this tier holds, per category, for memory_breakdown."""
        uploads = self.uploads.held() if self.uploads is not None else []
        return {"offload_buffers": list(self._staging.values()) + uploads}

    def nvme_bytes(self) -> int:
        """Bytes of this rank's swap files (0 without NVMe)."""
        return 0


@dataclass
class _SubGroup:
    fset: object
    span: object
    key: torch.Tensor
    lo: int          # within the span
    hi: int
    offset: int      # element offset in the swap files


class _Buffer:
    """One streaming buffer: master, exp_avg, exp_avg_sq parts and its own aio handle."""

    def __init__(self, numel: int, names: list[str], handle: AioHandle):
        self.flat = new_aligned_tensor(len(names) * numel, torch.float32)
        self.parts = {name: self.flat[i * numel:(i + 1) * numel] for i, name in enumerate(names)}
        self.handle = handle


class NvmeOptimizerTier(OptimizerTier):
    """Masters and Adam moments in swap files under `nvme_path`; see
    [Note: optimizer tiers] and [Note: streamed step].

    Args:
        nvme_path: the directory (checked, see swap.py).
        rank: this rank (the swap directory is per rank).
        buffer_count: sub-group buffers in memory (>= 1).
        sub_group_size: most elements per sub-group.
        pin_memory: accepted for DeepSpeed compatibility; the buffers are
            page-aligned and page-locked on CUDA machines anyway.
        aio: the config's `aio` section (block size, queue depth, threads).
        ratio: fraction of the elements offloaded (the rest stays in memory).

    Raises (at `prepare`): SwapError for an unusable nvme_path.
    """

    def __init__(self, nvme_path, rank: int, buffer_count: int, sub_group_size: int, pin_memory: bool, aio,
                 ratio: float = 1.0):
        super().__init__(host=True, pin_memory=pin_memory, sub_group_size=sub_group_size)
        self.device_kind = "nvme"
        self.nvme_path = nvme_path
        self.rank = rank
        self.buffer_count = max(1, int(buffer_count))
        self.aio = aio
        self.swap: SwapDir | None = None
        self._names: list[str] = []
        self._capacity = 0          # elements reserved per file
        self._next = 0              # next free element offset
        self._base: dict[tuple[int, int], int] = {}  # (id(fset), span.lo) -> file element offset
        self._groups: list[_SubGroup] = []  # streamed
        self._kept: list[tuple[_SubGroup, dict[str, torch.Tensor]]] = []  # in memory (ratio < 1)
        self.ratio = float(ratio)
        self._buffers: list[_Buffer] = []
        self._materialized = False
        self.stats = {"read_bytes": 0, "write_bytes": 0, "io_wait_s": 0.0, "compute_s": 0.0, "step_s": 0.0}

    def _handle(self) -> AioHandle:
        return AioHandle.from_config(self.aio, engine="auto" if self.swap.o_direct else "python")

    # ---- construction -------------------------------------------------------------------
    def prepare(self, strategy, param_numels: list[int], world_size: int) -> None:
        if not strategy.fused:
            raise ValueError(f"offload_optimizer.device nvme streams Adam states through dsrun's CPU Adam; "
                             f"{type(strategy.optimizer).__name__} cannot be streamed: set \"optimizer\" in "
                             "ds_config (Adam/AdamW) or pass dsrun.ops.adam.DeepSpeedCPUAdam")
        # Upper bound of the partition: each parameter's share rounded up, plus one
        # element of bucket padding per parameter (buckets hold whole parameters).
        self._capacity = sum(-(-n // world_size) + 1 for n in param_numels)
        self._names = (["master"] if self._needs_master(strategy) else []) + ["exp_avg", "exp_avg_sq"]
        files = {name: self._capacity * 4 for name in self._names}
        self.swap = SwapDir.create(self.nvme_path, self.rank, files, "offload_optimizer.nvme_path", "optimizer")
        weakref.finalize(self, self.swap.remove)  # an engine dropped before exit frees its files
        if not self.swap.o_direct and self.rank == 0:
            log.warning("offload_optimizer.nvme_path=%s: the filesystem does not support O_DIRECT; swap files "
                        "go through the page cache (buffered I/O)", self.nvme_path)

    @staticmethod
    def _needs_master(strategy) -> bool:
        # A separate fp32 master exists when the compute copy is 16-bit or not in host memory.
        return strategy.precision.mixed or strategy.topology.device.type != "cpu"

    def adopt(self, strategy, fset) -> None:
        """Assign file offsets to fset's spans and move its master (if any) into the file."""
        for span in fset.spans:
            self._base[(id(fset), span.lo)] = self._next
            self._next += span.hi - span.lo
        if self._next > self._capacity:  # the bound in prepare() is wrong: a bug, not bad input
            raise RuntimeError(f"NVMe optimizer tier: {self._next} elements exceed the reserved {self._capacity}")
        if fset.master is None:
            return
        with self._handle() as h:
            for span in fset.spans:
                self._io(h, True, "master", fset.master[span.lo:span.hi], self._base[(id(fset), span.lo)])
            self._wait(h)
        fset.master = None  # lives in the swap file from now on

    def bind(self, strategy) -> None:
        super().bind(strategy)
        groups = [_SubGroup(fset, span, key, lo, hi, self._base[(id(fset), span.lo)] + lo)
                  for fset, span, key in strategy.master_views
                  for lo, hi in _chunks(span.hi - span.lo, self.sub_group_size)]
        keep = round((1.0 - self.ratio) * sum(g.hi - g.lo for g in groups))
        while groups and groups[0].hi - groups[0].lo <= keep:  # the first (1 - ratio) stays in memory
            g = groups.pop(0)
            keep -= g.hi - g.lo
            self._kept.append((g, {name: torch.empty(g.hi - g.lo, dtype=torch.float32) for name in self._names}))
        self._load_kept()
        self._groups = groups
        largest = max([g.hi - g.lo for g in groups], default=0)
        self._buffers = [_Buffer(largest, self._names, self._handle())
                         for _ in range(min(self.buffer_count, len(groups)))]

    def _load_kept(self, write: bool = False) -> None:
        """Read the kept sub-groups from the swap files (write: the reverse)."""
        if self._kept:
            with self._handle() as h:
                for g, parts in self._kept:
                    for name, t in parts.items():
                        self._io(h, write, name, t, g.offset)
                self._wait(h)

    def close(self) -> None:
        super().close()
        for b in self._buffers:
            b.handle.close()
        self._buffers = []
        if self.swap is not None:
            self.swap.remove()

    # ---- I/O -------------------------------------------------------------------------------
    def _io(self, handle: AioHandle, write: bool, name: str, t: torch.Tensor, offset: int) -> None:
        try:
            (handle.async_pwrite if write else handle.async_pread)(t, self.swap.files[name], offset * 4)
        except OSError as e:
            raise self.swap.check(name, e) from None
        self.stats["write_bytes" if write else "read_bytes"] += t.numel() * 4

    def _wait(self, handle: AioHandle) -> None:
        t0 = time.perf_counter()
        try:
            handle.wait()
        except OSError as e:
            name = next((n for n, f in self.swap.files.items() if str(f) == (e.filename or "")), self._names[0])
            raise self.swap.check(name, e) from None
        finally:
            self.stats["io_wait_s"] += time.perf_counter() - t0

    def _read(self, k: int) -> None:
        g, buf = self._groups[k], self._buffers[k % len(self._buffers)]
        self._wait(buf.handle)  # its previous write is complete before it is overwritten
        n = g.hi - g.lo
        for name in self._names:
            self._io(buf.handle, False, name, buf.parts[name][:n], g.offset)

    # ---- the step ----------------------------------------------------------------------------
    def _fused_step(self, s, factor: float) -> None:
        """See [Note: streamed step]."""
        start = time.perf_counter()
        for key in ("read_bytes", "write_bytes", "io_wait_s", "compute_s"):
            self.stats[key] = 0 if key.endswith("bytes") else 0.0
        args = {}
        for fset, span, key in s.master_views:
            state = s.optimizer.state[key]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
            state["step"] += 1
            hyper = native_adam.adam_hyperparams(s.optimizer.param_groups[span.group], s.optimizer)
            args[id(key)] = dict(hyper, step=int(state["step"].item()), grad_scale=factor)
        with s.param_tier.stepping() as resident:
            for g, parts in self._kept:  # no I/O: these stay in memory
                resident(g.fset)
                self._update(g, parts, args)
            self._stream(s, resident, args)
        self.stats["step_s"] = time.perf_counter() - start

    def _update(self, g: _SubGroup, parts: dict[str, torch.Tensor], args: dict) -> None:
        """CPU Adam on sub-group g whose master (if separate) and moments are `parts`."""
        t0 = time.perf_counter()
        n = g.hi - g.lo
        copy = g.fset.copy_view(g.span)
        if "master" in parts:
            master = parts["master"][:n]
        else:  # the fp32 compute copy in host memory is the master
            master = g.fset.master_view(g.span)[g.lo:g.hi]
        self._cpu_adam(master, g.fset.grad_view(g.span)[g.lo:g.hi], parts["exp_avg"][:n], parts["exp_avg_sq"][:n],
                       None if copy is None else copy[g.lo:g.hi], args[id(g.key)])
        self.stats["compute_s"] += time.perf_counter() - t0

    def _stream(self, s, resident, args: dict) -> None:
        nb, groups = len(self._buffers), self._groups
        if groups:
            self._read(0)
        for k, g in enumerate(groups):
            if nb > 1 and k + 1 < len(groups):
                self._read(k + 1)  # in flight while k is updated
            buf = self._buffers[k % nb]
            self._wait(buf.handle)  # sub-group k is in the buffer
            resident(g.fset)
            self._update(g, buf.parts, args)
            n = g.hi - g.lo
            for name in self._names:
                self._io(buf.handle, True, name, buf.parts[name][:n], g.offset)
            if nb == 1 and k + 1 < len(groups):
                self._read(k + 1)
        for b in self._buffers:
            self._wait(b.handle)

    # ---- access outside the step ----------------------------------------------------------
    def materialize(self, s) -> None:
        if self._materialized:
            return
        self._load_kept(write=True)  # the files hold everything while materialized
        with self._handle() as h:
            for fset in s.sets:
                if "master" in self._names and fset.trainable_shard_numel:
                    fset.master = torch.empty(fset.trainable_shard_numel, dtype=torch.float32)
            for fset, span, key in s.master_views:
                base = self._base[(id(fset), span.lo)]
                state = s.optimizer.state[key]
                state.setdefault("step", torch.zeros((), dtype=torch.float32))
                if fset.master is not None:
                    self._io(h, False, "master", fset.master[span.lo:span.hi], base)
                for name in ("exp_avg", "exp_avg_sq"):
                    state[name] = torch.empty(span.hi - span.lo, dtype=torch.float32)
                    self._io(h, False, name, state[name], base)
            self._wait(h)
        self._materialized = True

    def settle(self, s) -> None:
        if not self._materialized:
            return
        with self._handle() as h:
            for fset, span, key in s.master_views:
                base = self._base[(id(fset), span.lo)]
                state = s.optimizer.state[key]
                if fset.master is not None:
                    self._io(h, True, "master", fset.master[span.lo:span.hi], base)
                for name in ("exp_avg", "exp_avg_sq"):
                    self._io(h, True, name, state[name].reshape(-1), base)
            self._wait(h)
        for fset, span, key in s.master_views:
            for name in ("exp_avg", "exp_avg_sq"):
                s.optimizer.state[key].pop(name, None)
        for fset in s.sets:
            if fset.separate_master:
                fset.master = None
        self._load_kept()
        self._materialized = False

    def held(self, strategy) -> dict[str, list[torch.Tensor]]:
        out = super().held(strategy)
        out["offload_buffers"] += [b.flat for b in self._buffers]
        out["master"] = [parts["master"] for _, parts in self._kept if "master" in parts]
        out["optimizer_states"] = [parts[k] for _, parts in self._kept for k in ("exp_avg", "exp_avg_sq")]
        return out

    def nvme_bytes(self) -> int:
        return self.swap.total_bytes() if self.swap is not None else 0

"""Copies between host memory and an accelerator for ZeRO-Offload, off the compute stream, and their timeline.

[Note: offload copies]
With `offload_optimizer.device: cpu` on a CUDA machine (ZeRO-Offload, Ren
et al., USENIX ATC 2021, sections 4.1-4.2) the device holds only the 16-bit
parameters, the gradient buckets of the reduction and the activations:

- Gradients leave the device region by region during backward
  (`HostGradients`): as soon as a region's reduction is finished its shard
  is copied, in the communication dtype (16 bits by default: half the
  bytes of fp32), on a copy stream into a page-locked host buffer; a host
  worker thread waits for that copy and writes the fp32 value (cast, then
  divided by the data-parallel size, as the in-memory path does on the
  device) into the host gradient partition. The training thread only
  issues copies; it waits for them once, at the end of backward.
- The first micro-step after `reset` (every step without gradient
  accumulation) writes the host partition instead of adding to it, so the
  partition is never zeroed, and its squared norm is summed on the device
  from the regions as they go (no pass over the host gradients); later
  micro-steps add, and the norm is then read from the host gradients.
- The CPU Adam updates the fp32 master and writes the 16-bit values into
  a page-locked staging buffer in the same pass (`Uploader`); the buffer
  goes to the device on the copy stream while Adam updates the next chunk
  of PIPELINE_NUMEL elements. Buffers rotate, so a buffer is reused only
  once its copy is done.

Copies run on one side stream per device (`CopyStream`): the side stream
first waits for the work already queued on the compute stream (the values
it reads are written, the memory it writes is free), and the compute
stream waits for the side stream (an event, on the device: the training
thread does not block) before it uses what was copied. Device tensors a
copy reads are marked as used by the side stream (`record_stream`), so the
caching allocator does not hand their memory out before the copy ran.

On a device that is host memory (CPU training) none of this exists: host
and device gradients are the same tensors and nothing is copied.

`OffloadTimeline` records each step's backward and copies (device time,
from CUDA events on the compute and copy streams), host gradient work,
waits and CPU Adam intervals relative to the start of backward; `format_timeline` prints one
step as totals and a bar per kind of work.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

# Elements the CPU Adam updates before their 16-bit values are sent to the device (32 MiB in bf16):
# small enough that the last chunk's copy is short, large enough that a copy's fixed cost is noise.
PIPELINE_NUMEL = 1 << 24
# Most elements per gradient bucket when gradients leave the device (stage 2 caps
# reduce_bucket_size at it): the device holds a few buckets in flight, 128 MiB each in fp32.
OFFLOAD_BUCKET_NUMEL = 1 << 25

KINDS = ("backward", "grads d2h", "grads on host", "wait grads", "adam", "params h2d", "wait params")


@dataclass
class _Interval:
    kind: str
    start: float   # seconds since the step's origin
    end: float
    nbytes: int = 0


@dataclass
class OffloadTimeline:
    """One step's offload work, kept for the last completed step.

    Kinds (KINDS): "backward" (the compute stream's backward, reductions
    included: device time on CUDA), "grads d2h" (device time of the gradient copies),
    "grads on host" (the worker's casts and adds), "wait grads" (the
    training thread waiting for them at the end of backward), "adam" (the
    CPU Adam), "params h2d" (device time of the parameter copies), "wait
    params" (the step waiting for a staging buffer or the last copy).
    CPU intervals are perf_counter times since `begin`; device intervals are
    CUDA event times since an event recorded at `begin` on the compute
    stream (the two clocks agree when the device is not behind the host).
    """

    _intervals: list[_Interval] = field(default_factory=list)
    _events: list = field(default_factory=list)  # (kind, start event, end event, bytes)
    _origin: float | None = None
    _origin_event: object = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    last: dict = field(default_factory=dict)

    def begin(self, device: torch.device) -> None:
        """Start of a step (its first backward); later calls in the same step are ignored."""
        if self._origin is not None:
            return
        self._origin = time.perf_counter()
        if device.type == "cuda":
            self._origin_event = torch.cuda.Event(enable_timing=True)
            self._origin_event.record(torch.cuda.current_stream(device))

    def cpu(self, kind: str, t0: float, t1: float, nbytes: int = 0) -> None:
        """A host interval [t0, t1] in perf_counter seconds (thread-safe)."""
        if self._origin is None:
            return
        with self._lock:
            self._intervals.append(_Interval(kind, t0 - self._origin, t1 - self._origin, nbytes))

    def device(self, kind: str, start, end, nbytes: int) -> None:
        """A device interval between two recorded CUDA events."""
        if self._origin is not None:
            self._events.append((kind, start, end, nbytes))

    def end(self) -> dict:
        """Close the step (all its events must have completed) and return its record."""
        if self._origin is None:
            return self.last
        for kind, start, end, nbytes in self._events:
            if self._origin_event is not None:
                self._intervals.append(_Interval(kind, self._origin_event.elapsed_time(start) / 1e3,
                                                 self._origin_event.elapsed_time(end) / 1e3, nbytes))
        wall = time.perf_counter() - self._origin
        totals = {k: {"ms": 0.0, "bytes": 0, "count": 0} for k in KINDS}
        for iv in self._intervals:
            t = totals.setdefault(iv.kind, {"ms": 0.0, "bytes": 0, "count": 0})
            t["ms"] += (iv.end - iv.start) * 1e3
            t["bytes"] += iv.nbytes
            t["count"] += 1
        self.last = {"wall_ms": wall * 1e3, "totals": totals,
                     "intervals": sorted(((iv.kind, iv.start * 1e3, iv.end * 1e3) for iv in self._intervals),
                                         key=lambda x: x[1])}
        self._intervals, self._events, self._origin, self._origin_event = [], [], None, None
        return self.last


def format_timeline(record: dict, width: int = 60) -> str:
    """A timeline record (OffloadTimeline.last) as text: per kind its total
    ms, MiB and count, and a bar of `width` columns over the step's wall
    time where '#' marks when that kind of work ran. Empty record: ''."""
    if not record:
        return ""
    wall = max([record["wall_ms"]] + [e for _, _, e in record["intervals"]]) or 1.0
    lines = [f"offload timeline: {record['wall_ms']:.1f} ms from backward start to step end"]
    for kind, t in record["totals"].items():
        bar = [" "] * width
        for k, s, e in record["intervals"]:
            if k == kind:
                for c in range(int(s / wall * width), min(width, int(e / wall * width) + 1)):
                    bar[c] = "#"
        mib = f" {t['bytes'] / 2**20:8.1f} MiB" if t["bytes"] else " " * 13
        lines.append(f"  {kind:<14}{t['ms']:9.1f} ms{mib} x{t['count']:<5}|{''.join(bar)}|")
    return "\n".join(lines)


class CopyStream:
    """Copies between host memory and `device` on a side stream (CUDA), or
    plain synchronous copies elsewhere. See [Note: offload copies].

    Args:
        device: the compute device.
        timeline: where each copy's device interval is recorded (None: not recorded).
    """

    def __init__(self, device: torch.device, timeline: OffloadTimeline | None = None):
        self.device = torch.device(device)
        # Its own stream, so copies overlap the kernels of the compute stream (backward, forward).
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.timeline = timeline

    def copy(self, dst: torch.Tensor, src: torch.Tensor, kind: str):
        """dst.copy_(src) after the work queued so far on the compute stream.
        Returns the CUDA event marking its end (None without a side stream:
        then the copy is done on return). Host tensors should be page-locked,
        or the copy is synchronous."""
        if self.stream is None:
            dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        for t in (src, dst):
            if t.device.type == "cuda":
                t.record_stream(self.stream)  # its memory is not reused before the copy ran
        if self.timeline is not None:
            self.timeline.device(kind, start, end, src.numel() * src.element_size())
        return end

    def join(self) -> None:
        """The compute stream waits (on the device) for every copy issued so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def pinned_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor of `numel` elements, page-locked when `pin` and CUDA is present."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin and torch.cuda.is_available())


class HostGradients:
    """Averaged gradient shards copied from the device into host gradient
    partitions while backward runs. See [Note: offload copies].

    Args:
        copies: the CopyStream of the compute device.
        timeline: where host intervals are recorded.
        pin: page-lock the staging buffers.
    """

    def __init__(self, copies: CopyStream, timeline: OffloadTimeline, pin: bool = True):
        self.copies = copies
        self.timeline = timeline
        self.pin = pin
        # One worker: the casts/adds of a region are multi-threaded torch ops already.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="dsrun-offload-grads")
        self._jobs: list[Future] = []
        self._last = None             # event of the last copy
        self.fresh = True             # nothing of this accumulation is in the host partitions yet
        self._written = False         # a backward wrote the partitions since `reset`
        self._sq: torch.Tensor | None = None  # device (1,) fp32: sum of squares while fresh
        self._micro_steps = 0
        self._scratch: torch.Tensor | None = None  # the worker's fp32 buffer for averaging before an add
        self._backward_start = None  # _mark() at the start of the running backward

    def reset(self) -> None:
        """A new accumulation starts (the strategy's zero_grad): the next
        backward writes the host partitions instead of adding to them."""
        self.fresh, self._written, self._sq, self._micro_steps = True, False, None, 0

    def begin(self) -> None:
        """A backward starts."""
        self.timeline.begin(self.copies.device)
        self._backward_start = self._mark()

    def _mark(self):
        """Now on the compute stream: a recorded CUDA event, or perf_counter seconds without a side stream."""
        if self.copies.stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.copies.device))
        return event

    def add(self, target: torch.Tensor, summed: torch.Tensor, divisor: int) -> None:
        """Make `target` (host, fp32 or the accumulation dtype) hold (fresh)
        or add summed / divisor, where `summed` is a device tensor of the
        same numel (the reduction's output, any float dtype). Returns at
        once; `drain` waits. Raises ValueError on a size mismatch."""
        if target.numel() != summed.numel():
            raise ValueError(f"host gradient slice of {target.numel()} elements, device shard of {summed.numel()}")
        if self.fresh:  # this micro-step's shard is the whole gradient: its norm now, on the device
            sq = torch.linalg.vector_norm(summed, dtype=torch.float32).square().reshape(1)
            self._sq = sq / float(divisor) ** 2 if self._sq is None else self._sq.add_(sq / float(divisor) ** 2)
        direct = self.fresh and divisor == 1 and summed.dtype == target.dtype
        staging = target if direct else pinned_empty(summed.numel(), summed.dtype, self.pin)
        self._last = self.copies.copy(staging, summed, "grads d2h")
        if not direct:
            self._jobs.append(self._worker.submit(self._on_host, self._last, staging, target, divisor, self.fresh))

    def _on_host(self, event, staging: torch.Tensor, target: torch.Tensor, divisor: int, fresh: bool) -> None:
        # The in-memory path's arithmetic (reducer.py): cast, divide, add -- without new tensors,
        # whose fresh pages would cost more than the arithmetic.
        if event is not None:
            event.synchronize()
        t1 = time.perf_counter()
        if fresh:
            target.copy_(staging)
            if divisor != 1:
                target.div_(divisor)
        elif divisor == 1:
            target.add_(staging)
        else:
            if self._scratch is None or self._scratch.numel() < staging.numel() or \
                    self._scratch.dtype != target.dtype:
                self._scratch = torch.empty(staging.numel(), dtype=target.dtype)
            value = self._scratch[:staging.numel()]
            value.copy_(staging).div_(divisor)
            target.add_(value)
        self.timeline.cpu("grads on host", t1, time.perf_counter(), staging.numel() * staging.element_size())

    def drain(self) -> None:
        """End of a backward: wait for every copy and host update (re-raising a worker's error)."""
        end, start, self._backward_start = self._mark(), self._backward_start, None
        if start is not None:
            if isinstance(end, float):
                self.timeline.cpu("backward", start, end)
            else:
                self.timeline.device("backward", start, end, 0)
        t0 = time.perf_counter()
        if self._last is not None:
            self._last.synchronize()
            self._last = None
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()
        self.timeline.cpu("wait grads", t0, time.perf_counter())
        self.fresh, self._written = False, True
        self._micro_steps += 1

    def written_elsewhere(self) -> None:
        """Host gradient partitions were changed after backward (a sum over
        ranks before the step: tied pipeline weights, tensor-parallel
        partial gradients): the device-side norm of the copies is stale, so
        `sq_norm` reads the host gradients."""
        self._sq = None

    def sq_norm(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Sum of squares of the host gradient shards `grads` as a (1,) fp32
        tensor on `device`: the device-side sum when one micro-step wrote
        them, else read from host memory (dsrun's SIMD norm, fp64
        accumulation). Zeroes them first when no backward ran since `reset`."""
        from dsrun.ops.adam import grad_sq_norm

        if not self._written:  # a step without backward: nothing was written since reset
            for g in grads:
                g.zero_()
            self._written = True
            return torch.zeros(1, dtype=torch.float32, device=device)
        if self._micro_steps == 1 and self._sq is not None:
            return self._sq
        total = sum(grad_sq_norm(g) for g in grads if g.numel())
        return torch.tensor([total], dtype=torch.float32, device=device)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


class Uploader:
    """Values computed in host memory sent to device tensors through
    `count` rotating page-locked buffers. See [Note: offload copies].

    Args:
        copies: the CopyStream of the device.
        timeline: where waits are recorded.
        count: buffers (>= 2 for overlap).
    """

    def __init__(self, copies: CopyStream, timeline: OffloadTimeline, count: int = 3):
        self.copies = copies
        self.timeline = timeline
        self._buffers: list[torch.Tensor | None] = [None] * max(1, count)
        self._events: list = [None] * len(self._buffers)
        self._next = 0

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next free buffer, (numel,) of `dtype` (waits for its previous copy)."""
        i = self._next
        if self._events[i] is not None:
            t0 = time.perf_counter()
            self._events[i].synchronize()
            self.timeline.cpu("wait params", t0, time.perf_counter())
            self._events[i] = None
        buf = self._buffers[i]
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self._buffers[i] = pinned_empty(max(numel, PIPELINE_NUMEL), dtype, True)
        return buf[:numel]

    def send(self, buf: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy `buf` (the buffer last returned by `buffer`) into device tensor `dst`."""
        self._events[self._next] = self.copies.copy(dst, buf, "params h2d")
        self._next = (self._next + 1) % len(self._buffers)

    def finish(self) -> None:
        """Every copy is done (host-side wait) and the compute stream is behind them."""
        t0 = time.perf_counter()
        for i, ev in enumerate(self._events):
            if ev is not None:
                ev.synchronize()
                self._events[i] = None
        self.copies.join()
        self.timeline.cpu("wait params", t0, time.perf_counter())

    def held(self) -> list[torch.Tensor]:
        return [b for b in self._buffers if b is not None]

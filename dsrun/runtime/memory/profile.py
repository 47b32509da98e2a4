"""Measured memory per phase of a training step: where the bytes of one rank go.

`dsrun.runtime.memory.accounting` predicts and counts the persistent ZeRO buffers; this
module measures what the process actually used while each phase ran. A
*phase* is a named stretch of code -- the engine's "forward", "backward"
(autograd and gradient reduction) and "step" (optimizer step, parameter
all-gather), "initialize" (all of `dsrun.initialize`), or any stretch a user
wraps in `phase(name)`, e.g. "construction" of the model:

    from dsrun.runtime.memory import profile as memory_profile
    with memory_profile.phase("construction"):
        model = build_model()
    engine, *_ = dsrun.initialize(model=model, config=cfg)  # "memory_breakdown": true
    ...
    print(memory_profile.format_memory_profile(engine.memory_profile()))

All sizes are bytes. What one phase record holds (`PhaseRecord`):

- process RSS at the start and end of the phase and its peak during the
  phase (see [Note: resetting the peak RSS]);
- on CUDA, the caching allocator's allocated bytes at start/end and their
  peak during the phase, and the reserved bytes at the end and their peak;
- the strategy's accounting of the tensors it holds at the end of the phase
  (`GradientStrategy.memory_breakdown()`: category -> dtype name -> bytes;
  "params", "grads", "master", "optimizer_states" and whatever categories a
  strategy adds);
- with `detailed=True`, the peak and end bytes of tensors *created during
  the phase* per device type, and the largest of those allocations (op,
  shape, dtype, bytes), found by watching every op's outputs (see [Note:
  tracking new tensors]). This is how a transient full-size copy shows up.

[Note: resetting the peak RSS]
On Linux the kernel keeps the process's peak RSS (VmHWM in
/proc/self/status, also what getrusage's ru_maxrss reports), and writing
"5" to /proc/self/clear_refs sets it back to the current RSS. A phase reads
VmRSS/VmHWM at its start, resets the peak, and reads both again at its end,
so the end's VmHWM is the phase's own peak. Resetting is process-wide, so a
phase that starts while others are open (nested phases, `initialize`
inside a user's "setup" phase) first folds the peak so far into every open
phase; the outer phases keep a correct peak. The reset also changes what
anything else in the process reads from VmHWM or ru_maxrss afterwards.
Where /proc/self/status is missing (macOS) the RSS comes from psutil and
the peak from ru_maxrss; where clear_refs cannot be written (some
containers, /proc mounted read-only) the peak is not reset. In both cases
the "peak" is the peak since the process started, which may predate the
phase; records say so with `rss_peak_reset = False`.

[Note: tracking new tensors]
`detailed=True` runs each phase under a TorchDispatchMode that sees every
aten op after autograd, including the ops autograd runs during backward.
An output whose storage is not one of the op's inputs' storages (views and
in-place ops return those) and not already tracked is a new allocation:
its storage's bytes are added to a live count per device type, the largest
few are remembered, and a weakref finalizer on the storage subtracts them
when the storage is freed. The peak of the live count is the most memory
that tensors born in this phase held at once. Tensors created outside the
dispatcher (e.g. by a C++ extension's own allocator, or the collective
library's internal buffers) are not seen, and the dispatch mode slows every
op, so use it for a few steps when looking for a spike, not always.
Without `detailed` the engine's phases cost two reads of /proc/self/status,
a write to clear_refs and one `memory_breakdown()` call each; with
profiling off they cost nothing but a shared no-op context (`no_phase`).
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import sys
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dsrun.runtime.memory import allocator

from dsrun.runtime.memory.accounting import DTYPE_NAMES

__all__ = ["MemoryProfiler", "MemorySnapshot", "PhaseRecord", "format_memory_profile",
           "no_phase", "phase", "recorded_phases"]

_MIB = float(1 << 20)

# -- reading RSS --------------------------------------------------------------------------
_PROC_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_use_proc: bool | None = None     # decided at the first read
_can_reset: bool | None = None    # decided at the first reset


def _read_proc_status() -> tuple[int, int]:
    with open(_PROC_STATUS, "rb") as f:
        text = f.read()
    found = {}
    for line in text.splitlines():
        if line.startswith((b"VmRSS:", b"VmHWM:")):
            found[line[:5]] = int(line.split()[1]) * 1024  # the kernel reports kB
    return found[b"VmRSS"], found[b"VmHWM"]


def _read_fallback() -> tuple[int, int]:
    import resource

    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return rss, max(rss, peak)


def _read_rss() -> tuple[int, int]:
    """(RSS now, peak RSS since the last reset or the process start), bytes."""
    global _use_proc
    if _use_proc is None:
        try:
            _read_proc_status()
            _use_proc = True
        except (OSError, KeyError, ValueError, IndexError):
            _use_proc = False
    return _read_proc_status() if _use_proc else _read_fallback()


def _reset_rss_peak() -> bool:
    """Set the kernel's peak RSS back to the current RSS; False where that is not possible."""
    global _can_reset
    if _can_reset is False or not _use_proc:
        return False
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        _can_reset = True
    except OSError:
        _can_reset = False
    return _can_reset


def rss_source() -> str:
    """How RSS and its peak are read in this process (shown in profiles)."""
    _read_rss()
    if not _use_proc:
        return "psutil RSS, getrusage peak (not resettable: peak since process start)"
    if _can_reset is False:
        return "/proc/self/status (clear_refs not writable: peak since process start)"
    return "/proc/self/status, peak reset per phase"


# -- reading CUDA -------------------------------------------------------------------------
def _cuda_index(device: torch.device | None) -> int | None:
    """The CUDA device to read, or None (a CPU device, or CUDA not initialised).

    Never initialises CUDA: doing so from every rank before it chose its
    device would put a context on GPU 0 for each of them.
    """
    if device is not None and device.type != "cuda":
        return None
    if not torch.cuda.is_initialized():
        return None
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device()


@dataclass(frozen=True)
class _CudaReading:
    allocated: int = 0
    allocated_peak: int = 0
    reserved: int = 0
    reserved_peak: int = 0


def _read_cuda(index: int | None) -> _CudaReading:
    if index is None:
        return _CudaReading()  # CUDA not initialised: nothing allocated yet
    stats = torch.cuda.memory_stats(index)
    return _CudaReading(stats.get("allocated_bytes.all.current", 0),
                        stats.get("allocated_bytes.all.peak", 0),
                        stats.get("reserved_bytes.all.current", 0),
                        stats.get("reserved_bytes.all.peak", 0))


@dataclass(frozen=True)
class MemorySnapshot:
    """Process memory at one moment, bytes; taking one changes nothing.

    Attributes:
        rss: resident set size now.
        rss_peak: the kernel's peak RSS since its last reset (or the
            process start).
        cuda: the CUDA allocator's counters on `cuda_index` (zeros when
            CUDA is not initialised).
        cuda_index: the CUDA device read, or None.
    """

    rss: int
    rss_peak: int
    cuda: _CudaReading
    cuda_index: int | None

    @classmethod
    def take(cls, device: torch.device | None = None) -> MemorySnapshot:
        """Read RSS (and CUDA counters of `device`, or the current CUDA device) now."""
        index = _cuda_index(device)
        return cls(*_read_rss(), _read_cuda(index), index)


# -- one open phase -----------------------------------------------------------------------
_open: list[_Measure] = []  # phases in progress in this process, outermost first


class _Measure:
    """RSS and CUDA peaks of one phase in progress (see [Note: resetting the peak RSS])."""

    def __init__(self, device: torch.device | None, since: MemorySnapshot | None) -> None:
        self.device = device
        now = _reset_peaks(device)
        since = since or now
        self.rss_start = since.rss
        self.cuda_start = since.cuda.allocated
        # Peak between `since` and the reset just made: exact when the kernel's
        # counter rose since `since`, else only the two readings are known.
        self.rss_peak = now.rss_peak if now.rss_peak > since.rss_peak else max(since.rss, now.rss)
        self.cuda_peak = (now.cuda.allocated_peak if now.cuda.allocated_peak > since.cuda.allocated_peak
                          else max(since.cuda.allocated, now.cuda.allocated))
        self.reserved_peak = (now.cuda.reserved_peak if now.cuda.reserved_peak > since.cuda.reserved_peak
                              else max(since.cuda.reserved, now.cuda.reserved))
        self.peak_reset = _can_reset is True
        _open.append(self)

    def fold(self, reading: MemorySnapshot) -> None:
        """Take in the peaks read just before another phase resets them."""
        self.rss_peak = max(self.rss_peak, reading.rss_peak)
        if reading.cuda_index is not None and reading.cuda_index == _cuda_index(self.device):
            self.cuda_peak = max(self.cuda_peak, reading.cuda.allocated_peak)
            self.reserved_peak = max(self.reserved_peak, reading.cuda.reserved_peak)

    def close(self, name: str, tensors: dict[str, dict[str, int]]) -> PhaseRecord:
        _open.remove(self)
        end = MemorySnapshot.take(self.device)
        cuda = end.cuda_index is not None
        return PhaseRecord(
            name=name, runs=1, rss_start=self.rss_start, rss_end=end.rss,
            rss_peak=max(self.rss_peak, end.rss_peak, end.rss), rss_peak_reset=self.peak_reset,
            cuda_allocated_start=self.cuda_start if cuda else None,
            cuda_allocated_end=end.cuda.allocated if cuda else None,
            cuda_allocated_peak=max(self.cuda_peak, end.cuda.allocated_peak) if cuda else None,
            cuda_reserved_end=end.cuda.reserved if cuda else None,
            cuda_reserved_peak=max(self.reserved_peak, end.cuda.reserved_peak) if cuda else None,
            tensors=tensors, host_cached_end=allocator.cached_bytes())


def _reset_peaks(device: torch.device | None) -> MemorySnapshot:
    """Fold the peaks so far into every open phase, reset them, and return what was read."""
    reading = MemorySnapshot.take(device)
    for measure in _open:
        measure.fold(reading)
    _reset_rss_peak()
    if reading.cuda_index is not None:
        torch.cuda.reset_peak_memory_stats(reading.cuda_index)
    return reading


# -- detailed mode: tensors born in a phase -------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, meta-like or wrapper-subclass tensors have no plain storage
    return (str(t.device), ptr) if ptr else None


class _NewTensorTracker(TorchDispatchMode):
    """Counts bytes of storages created by ops while active; see [Note: tracking new tensors].

    Attributes (bytes per device type, e.g. {"cpu": ..., "cuda": ...}):
        live: bytes of tracked storages still alive.
        peak: the most `live` has been.
    """

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self._top_k = top_k
        self._lock = threading.Lock()  # finalizers may run on autograd's threads
        self._tracked: dict[tuple[str, int], tuple[str, int, weakref.finalize]] = {}
        self._largest: list[tuple[int, int, dict]] = []  # min-heap of the top_k
        self._seq = itertools.count()
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outputs:
            inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            for t in outputs:
                self._note(func, t, inputs)
        return out

    def _note(self, func, t: torch.Tensor, inputs: set) -> None:
        key = _storage_key(t)
        if key is None or key in inputs or key in self._tracked:
            return  # a view of, or in place on, memory that already existed
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        device = t.device.type
        finalizer = weakref.finalize(storage, self._freed, key)
        finalizer.atexit = False
        with self._lock:
            self._tracked[key] = (device, nbytes, finalizer)
            self.live[device] = self.live.get(device, 0) + nbytes
            self.peak[device] = max(self.peak.get(device, 0), self.live[device])
        entry = {"op": func._schema.name, "shape": list(t.shape), "dtype": _dtype_name(t.dtype),
                 "device": device, "bytes": nbytes}
        item = (nbytes, next(self._seq), entry)
        if len(self._largest) < self._top_k:
            heapq.heappush(self._largest, item)
        elif nbytes > self._largest[0][0]:
            heapq.heapreplace(self._largest, item)

    def _freed(self, key: tuple[str, int]) -> None:
        with self._lock:
            found = self._tracked.pop(key, None)
            if found is not None:
                self.live[found[0]] -= found[1]

    def largest(self) -> list[dict]:
        """The largest allocations seen, biggest first."""
        return [entry for _, _, entry in sorted(self._largest, key=lambda x: (-x[0], x[1]))]

    def stop(self) -> None:
        """Drop the finalizers of storages still alive (the counts stay as they are)."""
        with self._lock:
            finalizers = [f for _, _, f in self._tracked.values()]
            self._tracked.clear()
        for f in finalizers:
            f.detach()


# -- records ------------------------------------------------------------------------------
@dataclass
class PhaseRecord:
    """What one phase used on this rank; every size is in bytes.

    Attributes:
        name: the phase ("forward", "backward", "step", "initialize", ...).
        runs: how many times it ran in the step this record covers (forward
            and backward run once per micro-batch); the start is that of the
            first run, the end that of the last, peaks are over all runs.
        rss_start, rss_end: process resident set size at the phase's start
            and end.
        rss_peak: the most RSS the process had during the phase (or since
            the process started when `rss_peak_reset` is False).
        rss_peak_reset: whether the kernel's peak counter was reset at the
            phase start (see [Note: resetting the peak RSS]).
        cuda_allocated_start, cuda_allocated_end, cuda_allocated_peak: bytes
            in live CUDA tensors (torch.cuda.memory_allocated) at start, end,
            and most during the phase; None off CUDA.
        cuda_reserved_end, cuda_reserved_peak: bytes the CUDA caching
            allocator held from the driver at the end and most during the
            phase (torch.cuda.memory_reserved); None off CUDA.
        tensors: category -> dtype name -> bytes the strategy holds at the
            end of the phase (`GradientStrategy.memory_breakdown()`); empty
            for phases outside an engine.
        new_tensors_peak: detailed mode only (else None): device type ->
            the most bytes held at once by tensors created during the phase.
        new_tensors_end: detailed mode only: device type -> bytes of those
            tensors still alive at the end (activations saved for backward,
            new gradients, optimizer state created at the first step).
        host_cached_end: bytes the caching host allocator kept for reuse at
            the end (part of rss_end, in no tensor; see [Note: caching host
            allocator] in dsrun/runtime/memory/allocator.py); None when it is not
            in use.
        largest: detailed mode only (else None): the largest tensors
            created in the phase, biggest first, each {"op": "aten::mul",
            "shape": [...], "dtype": "fp32", "device": "cuda", "bytes": n}.
    """

    name: str
    runs: int
    rss_start: int
    rss_end: int
    rss_peak: int
    rss_peak_reset: bool
    cuda_allocated_start: int | None = None
    cuda_allocated_end: int | None = None
    cuda_allocated_peak: int | None = None
    cuda_reserved_end: int | None = None
    cuda_reserved_peak: int | None = None
    tensors: dict[str, dict[str, int]] = field(default_factory=dict)
    new_tensors_peak: dict[str, int] | None = None
    new_tensors_end: dict[str, int] | None = None
    largest: list[dict] | None = None
    host_cached_end: int | None = None

    def merged_with(self, later: PhaseRecord, top_k: int) -> PhaseRecord:
        """One record for this run followed by `later` (same phase, same step)."""
        def peak(a, b):
            return None if a is None and b is None else max(a or 0, b or 0)

        new_peak = None
        if self.new_tensors_peak is not None or later.new_tensors_peak is not None:
            new_peak = dict(self.new_tensors_peak or {})
            for device, n in (later.new_tensors_peak or {}).items():
                new_peak[device] = max(new_peak.get(device, 0), n)
        largest = None
        if self.largest is not None or later.largest is not None:
            # The same allocation in each micro-batch is listed once.
            distinct = {}
            for e in sorted((self.largest or []) + (later.largest or []), key=lambda e: -e["bytes"]):
                distinct.setdefault((e["op"], tuple(e["shape"]), e["dtype"], e["device"]), e)
            largest = list(distinct.values())[:top_k]
        return replace(later, runs=self.runs + later.runs, rss_start=self.rss_start,
                       rss_peak=max(self.rss_peak, later.rss_peak),
                       rss_peak_reset=self.rss_peak_reset and later.rss_peak_reset,
                       cuda_allocated_start=self.cuda_allocated_start,
                       cuda_allocated_peak=peak(self.cuda_allocated_peak, later.cuda_allocated_peak),
                       cuda_reserved_peak=peak(self.cuda_reserved_peak, later.cuda_reserved_peak),
                       new_tensors_peak=new_peak, largest=largest)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict; fields that do not apply (None) are left out."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is None or name == "name":
                continue
            if name == "tensors":
                value = {c: dict(d) for c, d in value.items()}
            elif name == "largest":
                value = [dict(e, shape=list(e["shape"])) for e in value]
            elif isinstance(value, dict):
                value = dict(value)
            out[name] = value
        return out


_NO_PHASE = contextlib.nullcontext()


def no_phase(name: str) -> contextlib.AbstractContextManager:
    """Stand-in for `MemoryProfiler.phase` when profiling is off: a shared no-op context."""
    return _NO_PHASE


class MemoryProfiler:
    """Records a `PhaseRecord` for each phase run inside `phase(name)`.

    Phases recorded between two `end_step()` calls belong to one step; a
    phase that runs several times in a step (forward and backward with
    gradient accumulation) is merged into one record with `runs` > 1.

    Args:
        device: the device whose CUDA counters to read (a CPU device: none;
            None: the current CUDA device once CUDA is initialised).
        breakdown: called at each phase end for the `tensors` field
            (category -> dtype name -> bytes), e.g. a strategy's
            `memory_breakdown`; None leaves `tensors` empty.
        detailed: also track tensors created during each phase (slow; see
            [Note: tracking new tensors]).
        top_k: how many of the largest new tensors to keep per phase.
        merge_repeats: merge a phase that runs again before `end_step` into
            its record (the default); False replaces the record instead.
    """

    def __init__(self, device: torch.device | None = None,
                 breakdown: Callable[[], Mapping[str, Mapping[str, int]]] | None = None,
                 detailed: bool = False, top_k: int = 5, merge_repeats: bool = True) -> None:
        self.device = device
        self.detailed = detailed
        self.top_k = top_k
        self._merge_repeats = merge_repeats
        self._breakdown = breakdown
        self._current: dict[str, PhaseRecord] = {}
        self._last: dict[str, PhaseRecord] | None = None
        self._last_step: int | None = None

    @contextlib.contextmanager
    def phase(self, name: str, since: MemorySnapshot | None = None,
              detailed: bool | None = None) -> Iterator[None]:
        """Measure the `with` body as phase `name`.

        Args:
            name: the phase name (free text; the engine uses "forward",
                "backward", "step").
            since: start the phase at this earlier snapshot instead of now
                (for code that learns it should profile only part-way in,
                like `initialize` once it has read the config).
            detailed: track new tensors in this phase (None: the
                profiler's `detailed`).
        """
        measure = _Measure(self.device, since)
        detailed = self.detailed if detailed is None else detailed
        tracker = _NewTensorTracker(self.top_k) if detailed else None
        try:
            if tracker is None:
                yield
            else:
                with tracker:
                    yield
        finally:
            tensors = ({c: dict(d) for c, d in self._breakdown().items()}
                       if self._breakdown is not None else {})
            record = measure.close(name, tensors)
            if tracker is not None:
                tracker.stop()
                record.new_tensors_peak = dict(tracker.peak)
                record.new_tensors_end = {d: n for d, n in tracker.live.items()}
                record.largest = tracker.largest()
            if self._merge_repeats and name in self._current:
                record = self._current[name].merged_with(record, self.top_k)
            else:
                self._current.pop(name, None)  # re-inserted last: records stay in run order
            self._current[name] = record

    def end_step(self, step: int) -> None:
        """Close the current step: its phases become what `profile()` reports."""
        self._last, self._last_step = self._current, step
        self._current = {}

    def records(self) -> dict[str, PhaseRecord]:
        """The last closed step's records (before the first `end_step`: those so far)."""
        return dict(self._current if self._last is None else self._last)

    def profile(self) -> dict[str, Any]:
        """The records as a JSON-serialisable dict.

        Returns:
            {"step": the step the phases belong to (None before the first
            `end_step`), "rss_source": how RSS was read, "detailed": bool,
            "phases": {name: PhaseRecord.to_dict()}} in the order the phases
            first finished.
        """
        return {"step": self._last_step, "rss_source": rss_source(), "detailed": self.detailed,
                "phases": {name: r.to_dict() for name, r in self.records().items()}}


# -- phases outside an engine -------------------------------------------------------------
_setup = MemoryProfiler(merge_repeats=False)


def phase(name: str, since: MemorySnapshot | None = None,
          detailed: bool = False) -> contextlib.AbstractContextManager:
    """Measure a stretch outside the engine's step, e.g. `phase("construction")`.

    The record (see `PhaseRecord`) is kept for the whole process under its
    name (running a phase of the same name again replaces it) and appears
    first in every engine's `memory_profile()`. `dsrun.initialize` records
    "initialize" this way when the config sets "memory_breakdown": true.

    Args:
        name: the phase name.
        since: an earlier `MemorySnapshot.take()` to start the phase at.
        detailed: also track the tensors created in the phase (slow).
    """
    return _setup.phase(name, since, detailed)


def recorded_phases() -> dict[str, dict[str, Any]]:
    """The records of `phase(...)` calls so far in this process, as plain dicts."""
    return {name: r.to_dict() for name, r in _setup._current.items()}


# -- text ---------------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / _MIB:.1f}"


def format_memory_profile(profile: Mapping[str, Any], largest: int = 3) -> str:
    """A readable table (MiB) of a profile from `Engine.memory_profile()`.

    One row per phase: runs, RSS at the end, its peak and the peak above the
    phase's start ("+peak"); on CUDA allocated end/peak and reserved end;
    one column per tensor category (all dtypes summed) held at the phase's
    end; with detailed profiles the peak of tensors created in the phase,
    then, per phase, the largest (up to `largest`) of those tensors of at
    least 1 MiB.
    """
    phases: Mapping[str, Mapping[str, Any]] = profile.get("phases", {})
    if not phases:
        return "memory profile: no phases recorded"
    cuda = any("cuda_allocated_end" in r for r in phases.values())
    detailed = any("new_tensors_peak" in r for r in phases.values())
    categories: list[str] = []
    for r in phases.values():
        categories += [c for c in r.get("tensors", {}) if c not in categories]

    cached = any(r.get("host_cached_end") is not None for r in phases.values())
    header = ["phase", "runs", "rss", "rss_peak", "+peak"]
    if cached:
        header += ["host_cache"]
    if cuda:
        header += ["cuda_alloc", "cuda_peak", "cuda_reserved"]
    header += categories
    if detailed:
        header += ["new_peak"]
    rows = []
    for name, r in phases.items():
        row = [name, str(r["runs"]), _mib(r["rss_end"]), _mib(r["rss_peak"]),
               _mib(r["rss_peak"] - r["rss_start"])]
        if cached:
            row += [_mib(r.get("host_cached_end"))]
        if cuda:
            row += [_mib(r.get("cuda_allocated_end")), _mib(r.get("cuda_allocated_peak")),
                    _mib(r.get("cuda_reserved_end"))]
        tensors = r.get("tensors", {})
        row += [_mib(sum(tensors[c].values())) if c in tensors else "-" for c in categories]
        if detailed:
            new = r.get("new_tensors_peak")
            row += ["-" if new is None else _mib(sum(new.values()))]
        rows.append(row)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    title = "memory profile"
    if profile.get("rank") is not None:
        title += f" of rank {profile['rank']}"
    if profile.get("step") is not None:
        title += f" at step {profile['step']}"
    out = [f"{title} (MiB; RSS via {profile.get('rss_source', rss_source())})",
           line(header), *map(line, rows)]
    for name, r in phases.items():
        for e in [e for e in r.get("largest") or [] if e["bytes"] >= _MIB][:largest]:
            shape = "x".join(map(str, e["shape"])) or "scalar"
            out.append(f"  largest in {name}: {e['op']} [{shape}] {e['dtype']} {e['device']} "
                       f"{e['bytes'] / _MIB:.1f} MiB")
    return "\n".join(out)

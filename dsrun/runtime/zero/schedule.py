"""When stage 3 gathers, prefetches, keeps and frees units: the memory knobs.

[Note: the fetch trace]
During the first forward + backward (forwards without a backward before it,
such as an evaluation, are not kept) the strategy records the order in which
units are fetched (`trace`, unit indices; forward and backward in one
list, with the phase of each fetch in `trace_phases`). Later steps follow
it with a cursor. A prefetch is issued for backward when the fetch that
triggers it is for backward (as DeepSpeed) or the trace says its use is
(the last forward fetch prefetches the first backward units): ZeRO++ hpZ
gathers a unit for backward from its node (unit.py). That trace drives three of
DeepSpeed's stage-3 knobs, all in elements:

- stage3_prefetch_bucket_size (P): the prefetch window. When unit trace[i]
  is fetched, the units of the trace's next P elements (trace[i+1:], each
  counted once, gathered or not) are gathered ahead (async);
- stage3_max_live_parameters: prefetching never takes the gathered total
  above it, and a fetch that would evicts units kept for reuse (farthest
  next use first) before gathering;
- stage3_max_reuse_distance: after use, a unit whose next use in the trace
  comes within fewer than this many elements of other fetches is kept gathered
  instead of being freed and gathered again -- when those elements are at
  most P too, i.e. when its next use lies in the prefetch window (it would
  be gathered right back).

[Note: the gathered working set]
So every gathered unit that is not in use right now has its next use
within the next P elements of the trace: beyond the units in use, at most P
elements plus one unit are gathered (and never more than
stage3_max_live_parameters in all), whatever the depth of the model. The
window is counted over units gathered already, not only over those it
gathers: a fetch that gave P to new gathers only, skipping the units
gathered by the fetches before it, would slide the window P further at
every fetch, and with DeepSpeed's default max_live (1e9 elements) the whole
model ended up gathered (48 x Linear(2048, 2048), fp32, 2 ranks: all 768
MiB of it per rank, a peak of 2436 MiB against the model states' 1537;
1876 with the window; bench/memory/README.md).
Nor may a unit be kept for a reuse farther than the window: with the
default reuse distance (1e9) the forward then kept every unit for its
backward, the same 768 MiB.

Every decision depends only on the trace and sizes, which are the same on
every rank, so all ranks issue the same gathers in the same order. A fetch
that does not match the trace (the model took another path) switches the
schedule off until the next step: no prefetch, free after use.
"""
from __future__ import annotations

from typing import Sequence

from dsrun.runtime.offload.param_tier import ParamTier
from dsrun.runtime.zero.unit import Unit, UnitState


class GatherSchedule:
    """Prefetch / keep / evict decisions over `units` (see [Note: the fetch trace]).

    prefetch_numel, max_live_numel, max_reuse_distance: the three knobs, in
    elements (GatherPolicy's fields of those names, policies.py). Units
    marked persistent are never counted, kept or evicted. param_tier: where
    the units' partitions live (offload/param_tier.py); a tier with
    `lookahead` has the next units' partitions read in ahead of their
    gathers. None: nothing to read ahead.
    """

    def __init__(self, units: Sequence[Unit], prefetch_numel: int, max_live_numel: int,
                 max_reuse_distance: int, param_tier: ParamTier | None = None):
        self.units = units
        self.param_tier = param_tier
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.trace: list[int] = []
        self.trace_phases: list[str] = []
        self.recording = True
        self.pos = 0
        self.on_track = True
        self.in_use: set[int] = set()
        self.kept: set[int] = set()

    def live_numel(self) -> int:
        """Elements of non-persistent units gathered or being gathered."""
        return sum(u.numel for u in self.units if not u.persistent and u.state is not UnitState.SHARDED)

    def start_step(self) -> None:
        """A new forward begins: follow the trace from its start, free what was kept.
        While recording, a forward that no backward followed (an evaluation
        before training) is dropped from the trace: later steps would
        otherwise expect it."""
        self.pos, self.on_track = 0, True
        if self.recording:
            self.trace.clear()
            self.trace_phases.clear()
        for index in sorted(self.kept - self.in_use):
            self.units[index].release()
        self.kept &= self.in_use

    def end_recording(self) -> None:
        """The first backward finished: the trace is complete."""
        self.recording = False

    def fetch(self, unit: Unit, phase: str) -> None:
        """`unit` is needed now: gather it (making room first) and prefetch what follows."""
        self.in_use.add(unit.index)
        self.kept.discard(unit.index)
        if self.recording:
            self.trace.append(unit.index)
            self.trace_phases.append(phase)
        elif self.on_track and self.pos < len(self.trace) and self.trace[self.pos] == unit.index:
            self.pos += 1
        else:
            self.on_track = False
        if unit.state is UnitState.SHARDED:
            self._make_room(unit.numel)
        unit.wait(phase)
        if not self.recording and self.on_track:
            self._prefetch(phase)

    def done(self, unit: Unit) -> None:
        """`unit` is no longer needed now: keep it for reuse or free it."""
        self.in_use.discard(unit.index)
        if unit.persistent:
            return
        if self.on_track and not self.recording and self._reused_soon(unit):
            self.kept.add(unit.index)
        else:
            unit.release()

    def release_all(self) -> None:
        """End of backward: free every non-persistent unit."""
        for unit in self.units:
            unit.release()
        self.in_use.clear()
        self.kept.clear()

    def _prefetch(self, phase: str) -> None:
        """Gather the units of the window ahead (see [Note: the gathered working set])."""
        window = 0
        live = self.live_numel()
        in_backward = phase.startswith("backward")
        seen: set[int] = set()
        for index, traced in zip(self.trace[self.pos:], self.trace_phases[self.pos:]):
            if index in seen:
                continue
            seen.add(index)
            unit = self.units[index]
            window += unit.numel
            if window > self.prefetch_numel:
                break
            if unit.state is not UnitState.SHARDED:
                continue
            if live + unit.numel > self.max_live_numel:
                break
            live += unit.numel
            unit.gather(("backward" if in_backward else traced) + " prefetch")
        self._prefetch_partitions()

    def _prefetch_partitions(self) -> None:
        """Start reading the offloaded partitions of the next units of the
        trace not gathered yet (see [Note: parameter tiers])."""
        tier = self.param_tier
        if tier is None or not tier.lookahead:
            return
        ahead = 0
        for index in self.trace[self.pos:]:
            unit = self.units[index]
            if unit.state is UnitState.SHARDED:
                tier.prefetch(unit.fset)
                ahead += 1
                if ahead >= tier.lookahead:
                    break

    def _next_use_distance(self, unit: Unit) -> int | None:
        """Elements fetched between now and `unit`'s next use in the trace."""
        distance = 0
        for index in self.trace[self.pos:]:
            if index == unit.index:
                return distance
            distance += self.units[index].numel
        return None

    def _reused_soon(self, unit: Unit) -> bool:
        """Next use within max_reuse_distance and within the prefetch window
        (see [Note: the gathered working set])."""
        distance = self._next_use_distance(unit)
        return distance is not None and distance < self.max_reuse_distance and distance <= self.prefetch_numel

    def _make_room(self, numel: int) -> None:
        """Free kept units, farthest next use first, until `numel` more fits."""
        live = self.live_numel()
        if live + numel <= self.max_live_numel:
            return
        def distance(index: int) -> int:
            d = self._next_use_distance(self.units[index])
            return 1 << 62 if d is None else d
        for index in sorted(self.kept - self.in_use, key=distance, reverse=True):
            if live + numel <= self.max_live_numel:
                break
            self.units[index].release()
            self.kept.discard(index)
            live -= self.units[index].numel

"""Stage 3's gather schedule bounds what it holds gathered, whatever the depth.

The schedule (dsrun/runtime/zero/schedule.py) is driven here as the stage-3
strategy drives it -- a forward fetching and finishing unit after unit, a
backward doing the same in reverse -- over fake units that only record
their state, so every decision is visible without processes. Per
[Note: the gathered working set]: units gathered but not in use stay within
stage3_prefetch_bucket_size plus one unit for a stack of any depth, even
with DeepSpeed's default max_live and reuse distance (1e9 elements), while
prefetching and keeping for reuse still take place.
"""
import pytest

from dsrun.runtime.zero.schedule import GatherSchedule
from dsrun.runtime.zero.unit import UnitState

DEFAULT = 1_000_000_000  # DeepSpeed's default stage3_max_live_parameters and stage3_max_reuse_distance


class FakeUnit:
    """A unit of `numel` elements that records its gathers (phase names) instead of communicating."""

    def __init__(self, index: int, numel: int):
        self.index, self.numel, self.persistent = index, numel, False
        self.state = UnitState.SHARDED
        self.gathers: list[str] = []

    def gather(self, phase: str) -> None:
        if self.state is UnitState.SHARDED:
            self.gathers.append(phase)
            self.state = UnitState.GATHERING

    def wait(self, phase: str) -> None:
        self.gather(phase)
        self.state = UnitState.GATHERED

    def release(self, force: bool = False) -> None:
        self.state = UnitState.SHARDED


def _steps(layers: int, numel: int, prefetch: int, max_live: int = DEFAULT, reuse: int = DEFAULT,
           steps: int = 3) -> dict:
    """Drive `steps` training steps over a stack of `layers` equal units.

    Returns the most elements gathered but not in use at any point, the most
    gathered in all, and the gathers of the last step (total and prefetches).
    """
    units = [FakeUnit(i, numel) for i in range(layers)]
    sched = GatherSchedule(units, prefetch, max_live, reuse)
    worst = {"idle": 0, "live": 0}

    def note():
        gathered = [u for u in units if u.state is not UnitState.SHARDED]
        idle = sum(u.numel for u in gathered if u.index not in sched.in_use)
        worst["idle"] = max(worst["idle"], idle)
        worst["live"] = max(worst["live"], sum(u.numel for u in gathered))

    for _ in range(steps):
        for u in units:
            u.gathers.clear()
        sched.start_step()
        for order, phase in ((units, "forward"), (units[::-1], "backward")):
            for u in order:
                sched.fetch(u, phase)
                note()
                sched.done(u)
                note()
        sched.release_all()
        sched.end_recording()
    gathers = [g for u in units for g in u.gathers]
    return {**worst, "gathers": len(gathers), "prefetches": sum(g.endswith("prefetch") for g in gathers)}


@pytest.mark.parametrize("layers", [8, 48, 200])
def test_gathered_but_idle_stays_within_the_prefetch_window_at_default_knobs(layers):
    numel, prefetch = 10, 35
    r = _steps(layers, numel, prefetch)
    assert r["idle"] <= prefetch + numel, r
    assert r["live"] <= prefetch + 2 * numel, r  # the window, the unit in use, one finishing
    # Prefetch and reuse still work: all gathers but the first are issued
    # ahead, and the last k forward units, whose backward use comes after
    # the 2k units between (k of forward, k of backward), stay gathered
    # while those fit the window: 2k x numel <= prefetch.
    assert r["prefetches"] == r["gathers"] - 1, r
    assert 2 * layers - r["gathers"] == prefetch // (2 * numel) + 1, r


def test_max_live_still_caps_the_window():
    r = _steps(48, 10, prefetch=1000, max_live=30)
    assert r["live"] <= 30, r
    assert r["prefetches"] > 0, r


def test_no_window_no_prefetch_but_immediate_reuse_kept():
    r = _steps(16, 10, prefetch=0)
    assert r["prefetches"] == 0, r
    assert r["idle"] <= 10, r
    assert r["gathers"] == 2 * 16 - 1, r  # the last forward unit is reused by the first backward one


def test_reuse_distance_zero_frees_after_use():
    r = _steps(16, 10, prefetch=35, reuse=0)
    assert r["gathers"] == 2 * 16, r

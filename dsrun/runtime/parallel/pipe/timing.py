"""Opt-in timing of the pipeline executor's actions (`engine.action_timing`).

[Note: per-action timing]
With `PipelineEngine.action_timing = True`, `train_batch` times every action
of the rank's schedule and leaves in `engine.last_action_times`, per action
kind (its class name: "Forward", "RecvActivation", ...), a dict of

- count: how many ran in the step;
- total_s: their wall time (perf_counter around the executor's dispatch);
- wait_s: the part spent blocked on a neighbour (the stage link's
  `wait_seconds` over the action: receives and send completion);
- compute_s: for Forward / Backward / BackwardInput / BackwardWeight, the
  part inside the module's forward (and the loss function on the last
  stage) or the strategy's backward (autograd, the gradient hooks);
  the rest of total_s - wait_s is the executor's own work (dispatch, buffer
  bookkeeping, headers, tensor allocation: the per-action fixed cost);
- cpu_s: the CPU time of the executor's thread over the action
  (`time.thread_time`): the work it did, which other processes' load on
  the machine moves far less than the wall times (a receive's spin before
  it sleeps counts here; the sender and communication threads do not).

Off (the default), `train_batch` takes no timestamps per action; the check is
one attribute read per step.
"""
from __future__ import annotations

import time
from collections import defaultdict


class ActionTimer:
    """Accumulates the [Note: per-action timing] table of one step.

    Args:
        link: the engine's StageLink (its `wait_seconds` counts the waits).
    """

    def __init__(self, link) -> None:
        self._link = link
        self.table: dict[str, dict[str, float]] = defaultdict(
            lambda: {"count": 0, "total_s": 0.0, "wait_s": 0.0, "compute_s": 0.0, "cpu_s": 0.0})
        self._compute = 0.0

    def add_compute(self, seconds: float) -> None:
        """Count `seconds` of model or autograd time in the running action."""
        self._compute += seconds

    def run(self, action, fn) -> None:
        """Run `fn()` (the executor's dispatch of `action`), timing it."""
        waited, self._compute = self._link.wait_seconds, 0.0
        started, cpu = time.perf_counter(), time.thread_time()
        fn()
        row = self.table[type(action).__name__]
        row["count"] += 1
        row["total_s"] += time.perf_counter() - started
        row["cpu_s"] += time.thread_time() - cpu
        row["wait_s"] += self._link.wait_seconds - waited
        row["compute_s"] += self._compute

    def result(self) -> dict[str, dict[str, float]]:
        """The table as plain dicts (JSON-ready)."""
        return {kind: dict(row) for kind, row in self.table.items()}

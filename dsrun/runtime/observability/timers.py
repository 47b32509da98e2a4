"""Wall time of the phases of a training step, and the collectives' part of each.

`StepTimers.phase(name)` wraps the engine's forward, backward (autograd and
the gradient reduction it triggers) and step (optimizer step, parameter
all-gather). Each phase records its wall seconds and the collectives'
seconds and bytes inside it, read from the comms logger's running totals
(synchronous calls plus the time blocked in `wait()` of async ones, see
dsrun/runtime/comm/logger.py). A collective overlapped with backward and
finished before anyone waited costs no collective time here: what is
measured is the time the training thread spent in communication.

On CUDA the timers synchronize the device at phase boundaries only when
asked (`wall_clock_breakdown`), as DeepSpeed's timers do; otherwise a phase
measures launch time and its kernels' time lands in whatever synchronizes
next (the whole step stays right).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from dsrun.runtime.comm.logger import comms_logger

PHASES = ("forward", "backward", "step")


@dataclass
class PhaseTimes:
    """Totals of one phase over a period (one step, or the steps of a print period).

    Attributes:
        seconds: wall time in the phase.
        comm_seconds: time in collectives inside it (sync calls + waits).
        comm_bytes: message bytes of the collectives issued inside it.
        runs: times the phase ran (forward and backward: once per micro-batch).
        comm_inter_node_bytes: bus bytes of its collectives whose group spans
            nodes (comm/logger.py [Note: intra-node and inter-node bytes]).
    """

    seconds: float = 0.0
    comm_seconds: float = 0.0
    comm_bytes: int = 0
    runs: int = 0
    comm_inter_node_bytes: int = 0

    def add(self, other: PhaseTimes) -> None:
        self.seconds += other.seconds
        self.comm_seconds += other.comm_seconds
        self.comm_bytes += other.comm_bytes
        self.runs += other.runs
        self.comm_inter_node_bytes += other.comm_inter_node_bytes


@dataclass
class StepTimes:
    """Phase totals of one optimizer step (or of several, summed), seconds and bytes."""

    phases: dict[str, PhaseTimes] = field(default_factory=lambda: {p: PhaseTimes() for p in PHASES})
    steps: int = 0

    def add(self, other: StepTimes) -> None:
        for name, times in other.phases.items():
            self.phases.setdefault(name, PhaseTimes()).add(times)
        self.steps += other.steps

    @property
    def seconds(self) -> float:
        """Forward + backward + step."""
        return sum(p.seconds for p in self.phases.values())

    @property
    def comm_seconds(self) -> float:
        return sum(p.comm_seconds for p in self.phases.values())

    @property
    def comm_bytes(self) -> int:
        return sum(p.comm_bytes for p in self.phases.values())

    @property
    def comm_inter_node_bytes(self) -> int:
        return sum(p.comm_inter_node_bytes for p in self.phases.values())


class StepTimers:
    """Times the phases of the current step; `end_step()` hands them over.

    Args:
        device: the rank's device (synchronized when `synchronize` and CUDA).
        synchronize: synchronize CUDA at each phase start and end.
    """

    def __init__(self, device: torch.device, synchronize: bool) -> None:
        self._sync = synchronize and device.type == "cuda"
        self._current = StepTimes()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the `with` body's wall time and collectives to phase `name` of this step."""
        if self._sync:
            torch.cuda.synchronize()
        bytes0, comm0 = comms_logger.totals()
        inter0 = comms_logger.inter_node_bus_bytes()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            bytes1, comm1 = comms_logger.totals()
            self._current.phases.setdefault(name, PhaseTimes()).add(
                PhaseTimes(elapsed, comm1 - comm0, bytes1 - bytes0, 1,
                           comms_logger.inter_node_bus_bytes() - inter0))

    def end_step(self) -> StepTimes:
        """The times of the step that just ended; the next phase starts a new step."""
        done, self._current = self._current, StepTimes()
        done.steps = 1
        return done


def format_breakdown(times: StepTimes, global_step: int) -> str:
    """`wall_clock_breakdown`'s line: mean ms per step of each phase and the collectives' share.

    Example: "step 100 | time per step (ms, mean of 10): forward 12.1 | backward 40.3
    (collectives 9.8) | step 5.2 (collectives 2.0) | total 57.6 | collectives 11.8 ms = 20% | 3.1 MiB"
    (ranks on several nodes add "sent | 1.2 MiB across nodes": the bus bytes of collectives
    spanning nodes)
    """
    n = max(times.steps, 1)
    cells = []
    for name in PHASES:
        phase = times.phases.get(name, PhaseTimes())
        cell = f"{name} {phase.seconds / n * 1e3:.1f}"
        if phase.comm_seconds > 0:
            cell += f" (collectives {phase.comm_seconds / n * 1e3:.1f})"
        cells.append(cell)
    total = times.seconds / n
    comm = times.comm_seconds / n
    share = 100 * comm / total if total > 0 else 0.0
    return (f"step {global_step} | time per step (ms, mean of {times.steps}): " + " | ".join(cells)
            + f" | total {total * 1e3:.1f} | collectives {comm * 1e3:.1f} ms = {share:.0f}%"
            + f" | {times.comm_bytes / n / 2**20:.2f} MiB sent"
            + (f" | {times.comm_inter_node_bytes / n / 2**20:.2f} MiB across nodes"
               if times.comm_inter_node_bytes else ""))

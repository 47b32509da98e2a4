"""What a trial measured (the engine's result file), its metrics, and why a trial failed.

The result file is written by rank 0's engine after the last profile step
(dsrun/runtime/engine/autotuning_probe.py, [Note: autotuning trials]).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

METRICS = ("throughput", "latency", "flops")
# Exit statuses of a rank killed by SIGKILL (128 + 9): what the kernel's OOM killer leaves.
_KILLED = (137, -9)
_OOM = re.compile(r"out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory", re.IGNORECASE)


class ResultError(ValueError):
    """A result file that is missing a field or is not the engine's JSON; the message names the file."""


@dataclass(frozen=True)
class TrialResult:
    """One trial's measurements.

    step_seconds: wall time of each timed optimizer step (those after
    start_profile_step), seconds. peak_memory, base_memory: bytes per rank,
    in rank order (see the probe's note for what is read). host_available,
    device_total: bytes each rank's machine offered (device_total 0 on CPU).
    tokens: token ids consumed in the timed steps over all ranks (0: the
    inputs had none).
    """

    world_size: int
    ranks_per_node: int
    device: str
    num_params: int
    train_batch_size: int
    micro_batch: int
    grad_accum: int
    step_seconds: tuple[float, ...]
    tokens: int
    peak_memory: tuple[int, ...]
    base_memory: tuple[int, ...]
    host_available: tuple[int, ...]
    device_total: tuple[int, ...]

    @property
    def step_time(self) -> float:
        """Mean seconds per optimizer step over the timed steps."""
        return sum(self.step_seconds) / len(self.step_seconds)

    @property
    def samples_per_s(self) -> float:
        """Global samples per second: train_batch_size / step_time."""
        return self.train_batch_size / self.step_time

    @property
    def flops_per_s(self) -> float | None:
        """Model FLOP/s per rank, 6 x parameters x tokens/s / ranks (Kaplan et al., "Scaling Laws for
        Neural Language Models", 2020, sec. 2.1: forward + backward of a dense model); None without tokens."""
        if not self.tokens:
            return None
        return 6 * self.num_params * self.tokens / sum(self.step_seconds) / self.world_size

    @property
    def peak(self) -> int:
        """The highest peak memory of any rank, bytes."""
        return max(self.peak_memory)

    def metric(self, name: str) -> float | None:
        """The metric `name` (one of METRICS) as the table shows it: samples/s, seconds per step or FLOP/s."""
        return {"throughput": self.samples_per_s, "latency": self.step_time, "flops": self.flops_per_s}[name]

    def score(self, name: str) -> float | None:
        """The metric with larger = better (latency negated); None when it is unknown."""
        value = self.metric(name)
        return None if value is None else (-value if name == "latency" else value)


def read_result(path: Path) -> TrialResult:
    """Parse the engine's result file.

    Raises:
        ResultError: the file cannot be read, is not JSON, or lacks a field.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ResultError(f"{path}: not a trial result ({exc})") from exc
    try:
        result = TrialResult(
            int(data["world_size"]), int(data["ranks_per_node"]), str(data["device"]), int(data["num_params"]),
            int(data["train_batch_size"]), int(data["train_micro_batch_size_per_gpu"]),
            int(data["gradient_accumulation_steps"]), tuple(float(s) for s in data["step_seconds"]),
            int(data["tokens"]), tuple(int(m) for m in data["peak_memory"]),
            tuple(int(m) for m in data["base_memory"]), tuple(int(m) for m in data["host_available"]),
            tuple(int(m) for m in data["device_total"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ResultError(f"{path}: a trial result needs field {exc}") from exc
    if not result.step_seconds or min(result.step_seconds) <= 0:
        raise ResultError(f"{path}: no timed step (step_seconds {list(result.step_seconds)})")
    return result


def failure_reason(returncode: int, stderr: str, end_profile_step: int) -> str:
    """One line on why a trial gave no result: out of memory, or the exit status and the last error line.

    stderr: the trial's error output (dsrun's own lines and the ranks' prefixed ones).
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if returncode in _KILLED or any(_OOM.search(line) for line in lines):
        oom = [line for line in lines if _OOM.search(line)]
        return "out of memory" + (f": {oom[-1]}" if oom else " (killed by SIGKILL)")
    if returncode == 0:
        return (f"exited with status 0 before optimizer step {end_profile_step} (autotuning.end_profile_step): "
                "let the script run at least that many steps")
    # Prefer the ranks' own last error (an exception's last line) over dsrun's summary lines.
    rank_lines = [line for line in lines if line.startswith("[rank")]
    last = (rank_lines or lines or ["(no error output)"])[-1]
    return f"exit status {returncode}: {last}"

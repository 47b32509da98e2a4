"""The monitor interface every backend implements, and the event type they write."""
from __future__ import annotations

import abc
import os
from typing import Any, Iterable

Event = tuple[str, float, int]  # (name, value, step): TensorBoard's add_scalar arguments


class MonitorUnavailableError(RuntimeError):
    """A monitor is enabled in the config but the package it writes through is not installed."""


class Monitor(abc.ABC):
    """One output of training metrics (DeepSpeed's `deepspeed.monitor.monitor.Monitor`)."""

    @abc.abstractmethod
    def write_events(self, event_list: Iterable[Event]) -> None:
        """Record each (name, value, step); `step` is the x axis (DeepSpeed: samples seen)."""

    def update_config(self, config_dict: dict[str, Any]) -> None:
        """Store the run's config next to its metrics (default: nothing)."""

    def close(self) -> None:
        """Flush and release files (default: nothing)."""


def run_dir(output_path: str, job_name: str) -> str:
    """The directory one monitor writes a run to: output_path/job_name
    (DeepSpeed's rule; an empty output_path means the current directory)."""
    return os.path.join(output_path or ".", job_name)

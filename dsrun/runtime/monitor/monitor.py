"""`MonitorMaster`, which fans events out to every backend the config enables."""
from __future__ import annotations

from typing import Any, Iterable

from dsrun.runtime.config import DsConfig
from dsrun.runtime.monitor.base import Event, Monitor, MonitorUnavailableError  # noqa: F401 - DeepSpeed's names here
from dsrun.runtime.monitor.csv_monitor import CsvMonitor
from dsrun.runtime.monitor.tensorboard import TensorBoardMonitor
from dsrun.runtime.monitor.wandb_monitor import WandbMonitor


class MonitorMaster(Monitor):
    """Every monitor the config enables; writes on global rank 0 only.

    Args:
        config: the resolved config; its `tensorboard`, `csv_monitor` and
            `wandb` sections pick the backends.
        rank: this process's global rank; on any other rank than 0 nothing
            is created and every call does nothing.

    Attributes:
        enabled: some backend is enabled in the config (the same on every
            rank, so ranks can agree on work done for the monitors).
        monitors: the backends built on this rank (empty off rank 0).

    Raises:
        MonitorUnavailableError: a backend is enabled but `tensorboard` or
            `wandb` is not installed (the message names the pip extra).
    """

    def __init__(self, config: DsConfig, rank: int) -> None:
        self.enabled = config.tensorboard.enabled or config.csv_monitor.enabled or config.wandb.enabled
        self.monitors: list[Monitor] = []
        if rank != 0:
            return
        # Each backend imports its optional package (tensorboard, wandb) only when built.
        if config.tensorboard.enabled:
            self.monitors.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
        if config.csv_monitor.enabled:
            self.monitors.append(CsvMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
        if config.wandb.enabled:
            self.monitors.append(WandbMonitor(config.wandb.project, config.wandb.group, config.wandb.team))
        if self.monitors:
            self.update_config(config.model_dump(mode="json"))

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Write the events to every backend (rank 0; elsewhere nothing)."""
        events = list(event_list)
        for monitor in self.monitors:
            monitor.write_events(events)

    def update_config(self, config_dict: dict[str, Any]) -> None:
        for monitor in self.monitors:
            monitor.update_config(config_dict)

    def close(self) -> None:
        """Close every backend (flush and release files, finish the wandb
        run); later calls, and events written afterwards, do nothing."""
        monitors, self.monitors = self.monitors, []
        for monitor in monitors:
            monitor.close()

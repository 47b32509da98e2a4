"""`wandb`: events logged to Weights & Biases.

Needs the `wandb` package (`pip install dsrun[monitor]`). Offline runs
(`WANDB_MODE=offline`) write only to `./wandb/offline-run-*` (or under
WANDB_DIR) and send nothing; `wandb sync` uploads them later.
"""
from __future__ import annotations

from typing import Any, Iterable

from dsrun.runtime.monitor.base import Event, Monitor, MonitorUnavailableError


class WandbMonitor(Monitor):
    """Starts a W&B run (project, group, entity = team) and logs `{name: value}` at `step`.

    Raises:
        MonitorUnavailableError: the wandb package is not installed.
    """

    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise MonitorUnavailableError(
                f"config wandb.enabled needs the 'wandb' package ({exc}); install it with "
                "`pip install wandb` (or `pip install dsrun[monitor]`), or set wandb.enabled to false") from None
        self._wandb = wandb
        self.run = wandb.init(project=project, group=group, entity=team)

    def write_events(self, event_list: Iterable[Event]) -> None:
        # Events of one step go in one row: W&B requires non-decreasing steps per log call.
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in event_list:
            by_step.setdefault(step, {})[name] = value
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step)

    def update_config(self, config_dict: dict[str, Any]) -> None:
        self.run.config.update(config_dict, allow_val_change=True)

    def close(self) -> None:
        self.run.finish()

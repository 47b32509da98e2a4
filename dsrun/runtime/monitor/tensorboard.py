"""`tensorboard`: events through torch.utils.tensorboard's SummaryWriter.

Needs the `tensorboard` package (`pip install dsrun[monitor]`); the event
files go to `<output_path>/<job_name>/`, to be opened with
`tensorboard --logdir <output_path>`.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from dsrun.runtime.monitor.base import Event, Monitor, MonitorUnavailableError, run_dir


class TensorBoardMonitor(Monitor):
    """Writes each event as a scalar (`add_scalar(name, value, step)`) and flushes per batch.

    Raises:
        MonitorUnavailableError: the tensorboard package is not installed.
    """

    def __init__(self, output_path: str, job_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MonitorUnavailableError(
                f"config tensorboard.enabled needs the 'tensorboard' package ({exc}); install it with "
                "`pip install tensorboard` (or `pip install dsrun[monitor]`), or set "
                "tensorboard.enabled to false") from None
        self.log_dir = run_dir(output_path, job_name)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, event_list: Iterable[Event], flush: bool = True) -> None:
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def update_config(self, config_dict: dict[str, Any]) -> None:
        self.summary_writer.add_text("DeepSpeed/config", json.dumps(config_dict, indent=2), global_step=0)

    def close(self) -> None:
        self.summary_writer.close()

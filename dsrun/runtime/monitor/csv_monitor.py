"""`csv_monitor`: one CSV file per event name, as DeepSpeed writes them.

Layout: `<output_path>/<job_name>/<name with "/" and " " as "_">.csv`, each
with the header `step,<last part of the name>` and one `step,value` row per
event, e.g. Train_Samples_train_loss.csv. `dsrun-plot` reads these files.
"""
from __future__ import annotations

import csv
import json
import os
from typing import Any, Iterable

from dsrun.runtime.monitor.base import Event, Monitor, run_dir


def csv_file_name(event_name: str) -> str:
    """The file an event goes to: "Train/Samples/lr" -> "Train_Samples_lr.csv"."""
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


class CsvMonitor(Monitor):
    """Appends events to CSV files under output_path/job_name (created if missing).

    Files are opened in append mode for each batch of events and closed
    again, so a crash loses at most the batch being written and another
    process (dsrun-plot) can read them while training runs. A file that
    exists from an earlier run with the same job name is appended to.
    """

    def __init__(self, output_path: str, job_name: str) -> None:
        self.log_dir = run_dir(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)

    def write_events(self, event_list: Iterable[Event]) -> None:
        rows: dict[str, list[tuple[int, float]]] = {}
        for name, value, step in event_list:
            rows.setdefault(name, []).append((step, value))
        for name, values in rows.items():
            path = os.path.join(self.log_dir, csv_file_name(name))
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerows(values)

    def update_config(self, config_dict: dict[str, Any]) -> None:
        """Write deepspeed_config.csv (key, value per top-level key; sections as JSON)."""
        with open(os.path.join(self.log_dir, "deepspeed_config.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["key", "value"])
            for key, value in config_dict.items():
                writer.writerow([key, json.dumps(value) if isinstance(value, (dict, list)) else value])


csvMonitor = CsvMonitor  # DeepSpeed's class name

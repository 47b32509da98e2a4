"""What the tuner shows and leaves behind: the live table, results_dir/summary, ds_config_optimal.json.

Every candidate gets a row: the baseline (the user's own config), each
trial as it runs and ends (time per step, peak memory of the fullest rank,
samples/s, the chosen metric, or why it failed), and each candidate the
memory model ruled out (with the estimate that ruled it out). On a terminal
the table is redrawn live; otherwise one plain line is printed per trial
that ends. `write_summary` writes the same table as text (`summary`) and as
JSON (`summary.json`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from dsrun.autotuning.results import TrialResult
from dsrun.autotuning.space import Candidate

OPTIMAL_NAME = "ds_config_optimal.json"
SUMMARY_NAME = "summary"
_UNITS = {"throughput": "samples/s", "latency": "s/step", "flops": "FLOP/s per rank"}


@dataclass
class TrialRecord:
    """One row: a candidate and how far it got.

    status: "pending", "running", "ok", "failed", "pruned" (ruled out by the
    memory model, never launched) or "skipped" (the search ended first).
    """

    candidate: Candidate
    status: str = "pending"
    result: TrialResult | None = None
    reason: str = ""
    seconds: float = 0.0
    baseline: bool = False

    @property
    def label(self) -> str:
        return ("baseline " if self.baseline else "") + self.candidate.name


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _metric_text(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if metric != "flops" else f"{value:.3e}"


def render(records: list[TrialRecord], metric: str, best: TrialRecord | None = None,
           settings: bool = False) -> Table:
    """The table of every record; the best one is marked with a star.

    settings: add a column that spells each setting out (the trial's name
    already encodes it: z<stage>_mbs<micro-batch>_gas<accumulation>...).
    """
    table = Table(title=f"dsrun autotuning (metric: {metric}, {_UNITS[metric]})", title_justify="left")
    table.add_column("trial", no_wrap=True)
    if settings:
        table.add_column("setting")
    table.add_column("status", no_wrap=True)
    for header in ("time/step", "peak memory", "samples/s", *([metric] if metric != "throughput" else [])):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("note", overflow="fold")
    style = {"ok": "green", "failed": "red", "pruned": "dim", "running": "yellow", "skipped": "dim"}
    for r in records:
        res = r.result
        row = [("* " if r is best else "") + r.label, *([r.candidate.describe()] if settings else []),
               f"[{style[r.status]}]{r.status}[/]" if r.status in style else r.status,
               f"{res.step_time * 1e3:,.1f} ms" if res else "-", _mib(res.peak) if res else "-",
               f"{res.samples_per_s:,.1f}" if res else "-"]
        if metric != "throughput":
            row.append(_metric_text(res.metric(metric), metric) if res else "-")
        table.add_row(*row, escape(r.reason))
    return table


class LiveTable:
    """The table on `console`: redrawn in place on a terminal, else one line per finished trial."""

    def __init__(self, console: Console, metric: str) -> None:
        self._console, self._metric = console, metric
        self._live: Live | None = None

    def __enter__(self) -> LiveTable:
        if self._console.is_terminal:
            self._live = Live(render([], self._metric), console=self._console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, records: list[TrialRecord], finished: TrialRecord | None = None,
               best: TrialRecord | None = None) -> None:
        """Show `records`; `finished`: the trial that just ended (printed as a line when not live);
        `best`: the record to mark."""
        if self._live is not None:
            self._live.update(render(records, self._metric, best))
        elif finished is not None:
            res = finished.result
            text = (f"{res.step_time * 1e3:,.1f} ms/step, peak {_mib(res.peak)}, {res.samples_per_s:,.1f} samples/s"
                    if res else finished.reason)
            self._console.print(f"dsrun autotuning: {finished.label} ({finished.candidate.describe()}): "
                                f"{finished.status}: {text}", markup=False, highlight=False)


def best_record(records: list[TrialRecord], metric: str) -> TrialRecord | None:
    """The successful record with the best score for `metric` (ties: the earlier one)."""
    best, best_score = None, None
    for r in records:
        score = r.result.score(metric) if r.status == "ok" and r.result else None
        if score is not None and (best_score is None or score > best_score):
            best, best_score = r, score
    return best


def write_summary(results_dir: Path, records: list[TrialRecord], metric: str, best: TrialRecord | None) -> Path:
    """Write results_dir/summary (the table as text) and results_dir/summary.json; returns the text's path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / SUMMARY_NAME
    with open(path, "w") as f:
        Console(file=f, width=200, no_color=True, highlight=False).print(render(records, metric, best, settings=True))
        f.write(f"best: {best.label} ({best.candidate.describe()})\n" if best else "best: none (no trial succeeded)\n")
    rows = []
    for r in records:
        res = r.result
        rows.append({"trial": r.candidate.name, "baseline": r.baseline, "setting": r.candidate.describe(),
                     "status": r.status, "reason": r.reason, "wall_seconds": round(r.seconds, 3),
                     "step_seconds": res.step_time if res else None, "peak_memory_bytes": res.peak if res else None,
                     "peak_memory_per_rank": list(res.peak_memory) if res else None,
                     "samples_per_s": res.samples_per_s if res else None,
                     metric: res.metric(metric) if res else None, "best": r is best})
    (results_dir / "summary.json").write_text(json.dumps({"metric": metric, "trials": rows}, indent=1) + "\n")
    return path


def write_optimal(results_dir: Path, config: dict[str, object]) -> Path:
    """Write the best config as results_dir/ds_config_optimal.json, autotuning switched off; returns its path."""
    config = {**config, "autotuning": {**config.get("autotuning", {}), "enabled": False}}
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / OPTIMAL_NAME
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path

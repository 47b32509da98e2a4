"""`dsrun-plot RUN_DIR`: loss, learning rate, throughput and memory curves of a run, as a PNG.

RUN_DIR is a CSV monitor directory (the config's
`csv_monitor.output_path/job_name`); the files it reads are those the
engine writes every step (dsrun/runtime/monitor/events.py). Needs matplotlib
(`pip install dsrun[plot]`). Works while the run is still writing.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

import click

from dsrun.runtime.monitor import events
from dsrun.runtime.monitor.csv_monitor import csv_file_name

# Per panel: title, then (event, legend label, scale, y axis label) per line; the first
# line's axis is on the left, a line with another axis label gets a right-hand axis.
PANELS = (
    ("loss", [(events.TRAIN_LOSS, "train loss (rank 0)", 1.0, "loss")]),
    ("learning rate", [(events.LR, "lr", 1.0, "lr")]),
    ("throughput", [(events.SAMPLES_PER_SEC, "samples/s", 1.0, "samples/s"),
                    (events.TOKENS_PER_SEC, "tokens/s", 1.0, "tokens/s")]),
    ("memory and time", [(events.PEAK_MEMORY_BYTES, "peak memory (max over ranks)", 2.0**-30, "GiB"),
                         (events.STEP_TIME_MS, "step time", 1.0, "ms"),
                         (events.COMM_TIME_MS, "collectives", 1.0, "ms")]),
)


class PlotError(click.ClickException):
    """RUN_DIR holds nothing to plot, or matplotlib is missing."""


def read_series(run_dir: Path, event: str) -> tuple[list[float], list[float]]:
    """(x, y) of one event's CSV file in run_dir; empty lists when the file is absent.

    Rows that are not two numbers (a header repeated by a restarted run) are skipped.
    """
    path = run_dir / csv_file_name(event)
    xs, ys = [], []
    if not path.exists():
        return xs, ys
    with open(path, newline="") as f:
        for row in csv.reader(f):
            try:
                x, y = float(row[0]), float(row[1])
            except (ValueError, IndexError):
                continue
            xs.append(x)
            ys.append(y)
    return xs, ys


def _moving_average(ys: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(run_dir: str | os.PathLike, output: str | os.PathLike | None = None) -> Path:
    """Draw the run's curves into a PNG and return its path.

    Args:
        run_dir: a CSV monitor directory.
        output: the PNG to write (default: run_dir/training.png).

    Raises:
        PlotError: run_dir is not a directory, has no dsrun event files, or
            matplotlib is not installed.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir} is not a directory; pass the CSV monitor's output_path/job_name")
    data = {line[0]: read_series(run_dir, line[0]) for _, lines in PANELS for line in lines}
    if not any(xs for xs, _ in data.values()):
        raise PlotError(f"{run_dir} has no dsrun event files ({csv_file_name(events.TRAIN_LOSS)}, ...); "
                        "enable csv_monitor in the config and point dsrun-plot at output_path/job_name")
    try:
        import matplotlib
    except ImportError:
        raise PlotError("dsrun-plot needs matplotlib: pip install matplotlib (or dsrun[plot])") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, lines) in zip(axes.flat, PANELS):
        axis_of = {lines[0][3]: ax}
        handles = []
        for i, (event, label, scale, unit) in enumerate(lines):
            xs, ys = data[event]
            if not xs:
                continue
            if unit not in axis_of:
                axis_of[unit] = ax.twinx()
                axis_of[unit].set_ylabel(unit)
            target, color = axis_of[unit], colors[i % len(colors)]
            ys = [y * scale for y in ys]
            if event == events.TRAIN_LOSS and len(ys) >= 20:
                window = max(len(ys) // 20, 2)
                handles += target.plot(xs, ys, alpha=0.3, color=color, label=label)
                handles += target.plot(xs, _moving_average(ys, window), color=colors[1],
                                       label=f"mean of {window} steps")
            else:
                handles += target.plot(xs, ys, color=color, label=label)
        ax.set_title(title)
        ax.set_xlabel("samples")
        ax.set_ylabel(lines[0][3])
        ax.grid(alpha=0.3)
        if handles:
            ax.legend(handles=handles, loc="best", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"dsrun run {run_dir.resolve().name}")
    output = Path(output) if output is not None else run_dir / "training.png"
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG to write (default: RUN_DIR/training.png).")
def main(run_dir: Path, output: Path | None) -> None:
    """Draw loss, learning rate, throughput and memory of a run from its CSV monitor files (RUN_DIR)."""
    path = plot_run(run_dir, output)
    click.echo(f"dsrun-plot: wrote {path}")

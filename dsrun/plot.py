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

# (title, y label, [(event, legend label, scale)]) per panel; a panel with no data is left blank.
PANELS = (
    ("loss", "loss", [(events.TRAIN_LOSS, "train loss (rank 0)", 1.0)]),
    ("learning rate", "lr", [(events.LR, "lr", 1.0)]),
    ("throughput", "per second", [(events.SAMPLES_PER_SEC, "samples/s", 1.0),
                                  (events.TOKENS_PER_SEC, "tokens/s / 1000", 1e-3)]),
    ("memory and step time", "GiB | ms", [(events.PEAK_MEMORY_BYTES, "peak memory, GiB (max over ranks)", 2.0**-30),
                                          (events.STEP_TIME_MS, "step time, ms", 1.0),
                                          (events.COMM_TIME_MS, "collectives, ms", 1.0)]),
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
    data = {e: read_series(run_dir, e) for _, _, lines in PANELS for e, _, _ in lines}
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
    for ax, (title, ylabel, lines) in zip(axes.flat, PANELS):
        drawn = False
        for event, label, scale in lines:
            xs, ys = data[event]
            if not xs:
                continue
            ys = [y * scale for y in ys]
            if event == events.TRAIN_LOSS and len(ys) >= 20:
                ax.plot(xs, ys, alpha=0.3, label=label)
                window = max(len(ys) // 20, 2)
                ax.plot(xs, _moving_average(ys, window), label=f"mean of {window} steps")
            else:
                ax.plot(xs, ys, label=label)
            drawn = True
        ax.set_title(title)
        ax.set_xlabel("samples")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(loc="best", fontsize="small")
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

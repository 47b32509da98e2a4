"""dsrun-plot draws a PNG from the CSV monitor files of a real run."""
from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from dsrun.plot import PlotError, plot_run, read_series
from tests.dist_helpers import run_ranks
from tests.monitor.test_monitors import train


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_dsrun_plot_draws_the_run(tmp_path):
    extra = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    (result,) = run_ranks(train, 1, str(tmp_path), extra, 25, 1, timeout=120)
    xs, loss = read_series(tmp_path / "run", "Train/Samples/train_loss")
    assert len(xs) == 25 and loss == pytest.approx(result["losses"], rel=1e-6)

    done = subprocess.run([sys.executable, "-c", "from dsrun.plot import main; main()", str(tmp_path / "run"),
                           "-o", str(tmp_path / "curves.png")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'curves.png'}" in done.stdout
    assert png_size(tmp_path / "curves.png") == (1200, 800)


def test_nothing_to_plot_is_a_clear_error(tmp_path):
    with pytest.raises(PlotError, match="no dsrun event files"):
        plot_run(tmp_path)
    with pytest.raises(PlotError, match="not a directory"):
        plot_run(tmp_path / "missing")

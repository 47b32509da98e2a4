"""Launcher overhead: wall time of a 2-rank job whose ranks do nothing, and of a job where one rank fails.

Compared in the same run against (a) starting the two Python processes
directly (the floor) and (b) torchrun. Each case runs `--repeat` times,
interleaved so machine noise hits all cases alike; prints median and spread
(min-max) in seconds and the ratio of medians to the direct-start floor.

    .venv/bin/python bench/launcher/bench_launch.py [--repeat 7]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOOP = "import os\n"
# Rank 1 fails at once; rank 0 would sleep for a minute: measures teardown latency.
FAIL = "import os, time\nif os.environ['RANK'] == '1':\n    raise SystemExit(3)\ntime.sleep(60)\n"


def _timed(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return time.perf_counter() - start


def _direct(script: Path) -> list[str]:
    # Both ranks started together by a shell, as bare as a launcher can be.
    py = sys.executable
    return ["sh", "-c", f"RANK=0 {py} {script} & RANK=1 {py} {script} & wait"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "noop.py").write_text(NOOP)
        (cwd / "fail.py").write_text(FAIL)
        dsrun = [sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", "2", "--grace_period", "5"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0"]
        cases = {
            "noop: direct start (floor)": _direct(cwd / "noop.py"),
            "noop: dsrun": [*dsrun, "noop.py"],
            "noop: torchrun": [*torchrun, "noop.py"],
            "fail: dsrun": [*dsrun, "fail.py"],
            "fail: torchrun": [*torchrun, "fail.py"],
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeat):
            for name, argv in cases.items():
                times[name].append(_timed(argv, cwd))
    floor = statistics.median(times["noop: direct start (floor)"])
    print(f"{'case':32} {'median s':>9} {'min-max s':>13} {'vs floor':>9}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:32} {median:9.2f} {min(samples):6.2f}-{max(samples):<6.2f} {median / floor:9.2f}")


if __name__ == "__main__":
    main()

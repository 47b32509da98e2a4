"""Rank-aware console logging (rich) and the periodic training-progress line."""
from __future__ import annotations

import logging
import sys
import time

from rich.logging import RichHandler

from dsrun.runtime.distributed.dist import Topology

logger = logging.getLogger("dsrun")
if not logger.handlers:
    # Under a launcher stdout is a pipe, where rich would wrap every record at
    # 80 columns and pad it with blanks: plain one-line records there instead.
    if sys.stdout.isatty():
        _handler: logging.Handler = RichHandler(show_path=False, markup=False)
    else:
        _handler = logging.StreamHandler(sys.stdout)
        _handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_rank0(topology: Topology, message: str, level: int = logging.INFO) -> None:
    """Log `message` on global rank 0 only (other ranks stay quiet)."""
    if topology.is_rank_zero:
        logger.log(level, message)


class ProgressLog:
    """Every `steps_per_print` optimizer steps, log step, skipped, lr, mom and samples/s.

    Throughput is measured over the steps since the previous line (wall
    clock on rank 0; every rank processes the same number of samples per
    step, so rank 0's rate is the job's rate).
    """

    def __init__(self, topology: Topology, steps_per_print: int) -> None:
        self._topology = topology
        self._every = steps_per_print
        self._t0 = time.perf_counter()
        self._samples0 = 0

    def after_step(self, global_steps: int, skipped: int, global_samples: int,
                   lrs: list[float], moms: list) -> None:
        """Call after every optimizer step (boundary); logs when the period is reached."""
        if self._every <= 0 or global_steps % self._every:
            return
        now = time.perf_counter()
        rate = (global_samples - self._samples0) / max(now - self._t0, 1e-9)
        self._t0, self._samples0 = now, global_samples
        log_rank0(self._topology,
                  f"step={global_steps}, skipped={skipped}, lr=[{', '.join(f'{lr:.4g}' for lr in lrs)}], "
                  f"mom={moms}, samples/s={rate:.2f}")

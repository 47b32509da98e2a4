"""`log_dist`: log from chosen ranks, as DeepSpeed's `deepspeed.utils.log_dist`."""
from __future__ import annotations

import logging

from dsrun.runtime import comm
from dsrun.runtime.observability.logging import logger


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log "[Rank r] message" on the ranks listed in `ranks` ([-1]: every rank).

    As in DeepSpeed, with torch.distributed initialised and `ranks` empty or
    None nothing is logged; without it, the one process logs as rank -1.
    """
    initialized = comm.is_initialized()
    rank = comm.get_rank() if initialized else -1
    ranks = ranks or []
    if not initialized or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, f"[Rank {rank}] {message}")

"""Timing statistics and the comparison table every bench/ops command prints."""
from __future__ import annotations

import statistics
from typing import Sequence


def table(title: str, rows: Sequence[tuple[str, Sequence[float]]], baseline: str, unit: str = "ms",
          higher_is_better: bool = False) -> str:
    """Format rows of (case, samples) as median / min / max and the ratio of each
    median to the baseline's median (measured in the same run).

    The ratio is case median / baseline median: below 1 is better for times,
    above 1 is better for throughputs (higher_is_better).
    """
    base = statistics.median(dict(rows)[baseline])
    width = max(len(name) for name, _ in rows)
    head = f"{'case':<{width}}  {'median':>9}  {'min':>9}  {'max':>9}  {'ratio':>6}   ({unit}, n={len(rows[0][1])})"
    lines = [title, head, "-" * len(head)]
    for name, samples in rows:
        med = statistics.median(samples)
        lines.append(f"{name:<{width}}  {med:9.2f}  {min(samples):9.2f}  {max(samples):9.2f}  {med / base:6.2f}"
                     + ("   <- baseline" if name == baseline else ""))
    lines.append(f"ratio = median / median of '{baseline}'" + (" (higher is better)" if higher_is_better
                                                                 else " (lower is better)"))
    return "\n".join(lines)

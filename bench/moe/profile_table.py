"""Every rank's profile from moe_client.py --profile, per run, side by side
(used by vs_deepspeed.py --profile).

First the CPU rows: each rank's process CPU ms per step, then main-thread
CPU ms per step in each labelled range (step.*, moe.*) and in the whole
step, and the other threads' (gloo's, a communication thread's): CPU time
does not grow when other processes hold the cores, so these compare the
libraries' work on a loaded machine. Then torch.profiler's events, wall
ms per step: per run and event the mean over the ranks and the
lowest-highest rank, of the own time (the op's time outside the ops it
called: for a blocking collective that includes the wait for the other
ranks) or, for the labelled ranges and autograd's backward nodes (whose
own time is only bookkeeping), the inclusive time.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

LABELS = ("step.forward", "step.backward", "step.step", "moe.gate", "moe.experts")
THREADS = ("main thread",) + LABELS + ("other threads",)


def load(directory: Path, case: str) -> list[dict]:
    """The rank files of one run and case (ep<P>-z<stage>) in `directory`, by rank."""
    files = sorted(directory.glob(f"*-{case}-r*.json"), key=lambda f: int(f.stem.rsplit("-r", 1)[1]))
    return [json.loads(f.read_text()) for f in files]


def _spread(values: list[float]) -> str:
    if not any(values):
        return "-"
    return f"{statistics.mean(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def _cell(ranks: list[dict], name: str, column: int) -> str:
    return _spread([r["events"].get(name, [0.0, 0.0, 0.0])[column] for r in ranks])


def table(by_library: dict[str, list[dict]], top: int = 25) -> str:
    """Markdown (see the module docstring): `by_library` maps a run's name
    to its ranks' files; the `top` events by the largest run mean, each as
    mean (lowest-highest rank) ms per step, and calls per step."""
    libraries = list(by_library)
    head = "| event | " + " | ".join(f"{lib}: ms/step, mean (min-max rank)" for lib in libraries) + " | calls/step |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    cpu = [", ".join(f"{statistics.median(r['cpu_s']) * 1e3:.0f}" for r in ranks) for ranks in by_library.values()]
    lines.append("| CPU ms per step, rank 0, 1, ... (process time, median step) | " + " | ".join(cpu) + " | |")
    for name in THREADS:
        lines.append(f"| CPU ms: {name} | "
                     + " | ".join(_spread([r["thread_cpu_ms"].get(name, 0.0) for r in ranks])
                                  for ranks in by_library.values()) + " | |")

    def row(name: str, column: int, shown: str) -> str:
        calls = "/".join(f"{statistics.mean(r['events'].get(name, [0, 0, 0])[2] for r in ranks):g}"
                         for ranks in by_library.values())
        return f"| {shown} | " + " | ".join(_cell(ranks, name, column) for ranks in by_library.values()) \
            + f" | {calls} |"
    for name in LABELS:
        lines.append(row(name, 1, f"wall: {name} (inclusive)"))
    names = {n for ranks in by_library.values() for r in ranks for n in r["events"]} - set(LABELS)

    def weight(name: str) -> float:
        column = 1 if name.startswith("autograd::engine::evaluate_function") else 0
        return max(statistics.mean(r["events"].get(name, [0, 0, 0])[column] for r in ranks)
                   for ranks in by_library.values())
    for name in sorted(names, key=weight, reverse=True)[:top]:
        backward_node = name.startswith("autograd::engine::evaluate_function")
        shown = name.replace("autograd::engine::evaluate_function: ", "backward: ")
        lines.append(row(name, 1 if backward_node else 0, shown + (" (inclusive)" if backward_node else "")))
    return "\n".join(lines)

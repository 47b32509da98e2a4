"""Synthetic trial results for the autotuner's unit tests."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dsrun.autotuning.results import TrialResult

MIB = 2**20


def result(**changes) -> TrialResult:
    """A two-rank CPU result: 10M parameters, micro-batch 2 x 8 of a global batch 32, 300 MiB at start."""
    base = TrialResult(world_size=2, ranks_per_node=2, device="cpu", num_params=10_000_000, train_batch_size=32,
                       micro_batch=2, grad_accum=8, step_seconds=(0.5, 0.5), tokens=0,
                       peak_memory=(320 * MIB, 318 * MIB), base_memory=(300 * MIB, 299 * MIB),
                       host_available=(1024 * MIB, 1024 * MIB), device_total=(0, 0))
    return replace(base, **changes)


def write_result(path: Path, r: TrialResult) -> None:
    """Write `r` as the engine's probe writes a result file."""
    path.write_text(json.dumps({
        "world_size": r.world_size, "ranks_per_node": r.ranks_per_node, "device": r.device,
        "num_params": r.num_params, "train_batch_size": r.train_batch_size,
        "train_micro_batch_size_per_gpu": r.micro_batch, "gradient_accumulation_steps": r.grad_accum,
        "step_seconds": list(r.step_seconds), "tokens": r.tokens, "peak_memory": list(r.peak_memory),
        "base_memory": list(r.base_memory), "host_available": list(r.host_available),
        "device_total": list(r.device_total)}))

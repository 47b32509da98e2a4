"""The engine's side of an autotuning trial: time the profile steps, write the result, stop.

[Note: autotuning trials]
`dsrun --autotuning` (dsrun/autotuning) launches each candidate setting as a
real run of the user's script with two changes: the config it is given has
`autotuning.enabled` true, and every rank gets DSRUN_AUTOTUNING_RESULT, the
path of the trial's result file. With both, the engine's `AutotuningProbe`
keeps the wall time of every optimizer step numbered above
`autotuning.start_profile_step` (the earlier ones are warm-up: first-touch
allocations, lazy optimizer state, caches). After step `end_profile_step`
all ranks exchange their peak memory (one all_gather_object), rank 0 writes
the JSON result file (the fields of `dsrun.autotuning.results.TrialResult`)
and every rank leaves with exit status 0: the trial has what it needs, and
the launcher sees a clean exit. Without the variable (a plain run, the
final `run` of the tuner) `autotuning.enabled` changes nothing.

A rank's peak memory is the CUDA allocator's peak on an accelerator and the
kernel's peak RSS (VmHWM) on CPU (dsrun.runtime.memory.profile), read after
every step up to the last profile step; `base_memory` is the same reading
when the engine was built (model, ZeRO buffers, no activation yet), which
the tuner uses to tell fixed memory from per-sample memory. Each rank also
reports what its machine offers (the device's total memory; the host RAM
available at start, psutil), so that the tuner's memory budget is that of
the machines that run the ranks, not of the one that runs the tuner.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil
import torch

from dsrun.env import AUTOTUNING_RESULT
from dsrun.runtime import comm
from dsrun.runtime.engine.train_state import TrainingParts
from dsrun.runtime.memory.profile import MemorySnapshot


class AutotuningProbe:
    """Measures an autotuning trial (see [Note: autotuning trials]); inert outside one.

    Args:
        parts: the engine's training parts (config, topology, module, counters).
        environ: where DSRUN_AUTOTUNING_RESULT is read (default: os.environ).
    """

    def __init__(self, parts: TrainingParts, environ: dict[str, str] | None = None) -> None:
        self._parts = parts
        path = AUTOTUNING_RESULT.read(environ)
        self.active = path is not None and parts.config.autotuning.enabled
        self._path: Path | None = path
        self._step_seconds: list[float] = []
        self._tokens = 0
        self._base = self._memory() if self.active else 0
        self._peak = self._base
        self._host_available = psutil.virtual_memory().available if self.active else 0

    def _memory(self) -> int:
        """This rank's peak memory so far, bytes (CUDA allocator on an accelerator, else peak RSS)."""
        device = self._parts.topology.device
        snap = MemorySnapshot.take(device)
        return snap.cuda.allocated_peak if device.type == "cuda" else snap.rss_peak

    def end_step(self, seconds: float, tokens: int) -> None:
        """Record the optimizer step that just ended (every rank); after the last profile step
        write the result and exit the process with status 0.

        seconds: the step's wall time; tokens: token ids it consumed over all ranks (0: unknown).
        """
        if not self.active:
            return
        cfg, step = self._parts.config.autotuning, self._parts.state.global_steps
        self._peak = max(self._peak, self._memory())
        if step > cfg.start_profile_step:
            self._step_seconds.append(seconds)
            self._tokens += tokens
        if step < cfg.end_profile_step:
            return
        device = self._parts.topology.device
        mine = {"peak": self._peak, "base": self._base, "host_available": self._host_available,
                "device_total": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0}
        every = comm.all_gather_object(mine) if self._parts.topology.world_size > 1 else [mine]
        if self._parts.topology.is_rank_zero:
            self._write(every)
        if self._parts.topology.world_size > 1:
            comm.barrier()
        sys.stdout.flush()
        sys.exit(0)

    def _write(self, every: list[dict]) -> None:
        config, module = self._parts.config, self._parts.module
        params = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)
        result = {
            "world_size": self._parts.topology.world_size,
            "ranks_per_node": self._parts.topology.local_world_size,
            "device": self._parts.topology.device.type,
            "num_params": int(params),
            "train_batch_size": config.train_batch_size,
            "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "step_seconds": self._step_seconds,
            "tokens": self._tokens,
            "peak_memory": [int(r["peak"]) for r in every],
            "base_memory": [int(r["base"]) for r in every],
            "host_available": [int(r["host_available"]) for r in every],
            "device_total": [int(r["device_total"]) for r in every],
        }
        tmp = self._path.with_name(self._path.name + f".tmp{os.getpid()}")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, self._path)

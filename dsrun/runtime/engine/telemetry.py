"""What the engine reports about each optimizer step: monitors, timers, progress, flops profile.

The engine calls four things and knows nothing else about reporting:
`phase(name)` around forward/backward/step, `observe_inputs` and
`observe_loss` for each micro-batch, and `end_step()` after each optimizer
step. From these `StepTelemetry` produces, as the config asks:

- monitor events (events.py) on the engine's monitor, rank 0 writing,
  with the MoE layers' expert load ([Note: MoE in the monitors] in
  dsrun/runtime/parallel/expert/watch.py);
- the `wall_clock_breakdown` line every `steps_per_print` steps (timers.py);
- progress records for dsrun's launcher (dsrun/launcher/progress.py);
- the `flops_profiler` report at `profile_step` (dsrun/profiling);
- an autotuning trial's measurements (autotuning_probe.py), which end the run.

[Note: peak memory in the monitors]
`Train/Samples/peak_memory_bytes` is the highest peak over all ranks, taken
by a one-element all_reduce(MAX) after every step while a monitor is on
(every rank knows the config, so every rank joins it; it is outside the
timed phases, so it is not in the step's comm figures). A rank's peak is
what dsrun.runtime.memory.profile measured for the step's phases when
memory profiling is on; otherwise the kernel's peak RSS of the process so
far (VmHWM), or on CUDA the allocator's peak allocated bytes so far. Rank
0's own figure would miss the rank that runs out of memory first: ZeRO
partitions are not equal in size on every rank.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from dsrun.launcher.progress import encode_record, progress_enabled
from dsrun.runtime import comm
from dsrun.runtime.data_pipeline.curriculum import tokens_of
from dsrun.runtime.observability.logging import log_rank0
from dsrun.runtime.memory.profile import MemorySnapshot
from dsrun.runtime.monitor import MonitorMaster, events
from dsrun.runtime.offload.transfer import format_timeline
from dsrun.runtime.parallel.expert.watch import MoEWatch
from dsrun.runtime.observability.timers import StepTimes, StepTimers, format_breakdown
from dsrun.runtime.engine.autotuning_probe import AutotuningProbe
from dsrun.runtime.engine.train_state import TrainingParts

if TYPE_CHECKING:
    from dsrun.profiling.flops_profiler import FlopsProfiler

_RECORD_INTERVAL_S = 0.5  # most progress records per second: 2


class StepTelemetry:
    """Measures each training step and reports it (see the module docstring).

    Args:
        parts: the engine's training parts (reads the config, the counters,
            the optimizer's lr and the strategy's loss scale).
        monitor: where events go (the engine's MonitorMaster).
        memory_profile: returns the engine's memory profile of the last
            step ({} when profiling is off; see Engine.memory_profile).
    """

    def __init__(self, parts: TrainingParts, monitor: MonitorMaster,
                 memory_profile: Callable[[], dict]) -> None:
        self._parts, self._monitor, self._memory_profile = parts, monitor, memory_profile
        cfg = parts.config
        self._rank0 = parts.topology.is_rank_zero
        self._timers = StepTimers(parts.topology.device, synchronize=cfg.wall_clock_breakdown)
        self._breakdown = cfg.wall_clock_breakdown
        self._period = StepTimes()
        self._records = progress_enabled() and self._rank0
        self._total = _scheduler_total(cfg)
        self._last_record = -math.inf
        self._needs_loss = monitor.enabled or self._records
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._tokens = 0
        self._step_start: float | None = None  # end of the previous step, or the first forward
        self._flops_cfg = cfg.flops_profiler
        self._flops: FlopsProfiler | None = None
        self._flops_done = not (cfg.flops_profiler.enabled and self._rank0)
        self._autotuning = AutotuningProbe(parts)
        self._moe = MoEWatch(parts.module, parts.topology.rank)

    # -- per micro-batch ---------------------------------------------------------------------
    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """Time the `with` body as phase `name` ("forward", "backward", "step")."""
        if name == "forward" and not self._flops_done and self._flops is None \
                and self._parts.state.global_steps == self._flops_cfg.profile_step:
            return self._profiled_forward()
        return self._timers.phase(name)

    @contextlib.contextmanager
    def _profiled_forward(self) -> Iterator[None]:
        from dsrun.profiling.flops_profiler import FlopsProfiler

        self._flops = FlopsProfiler(self._parts.module, recompute_fwd_factor=self._flops_cfg.recompute_fwd_factor)
        with self._timers.phase("forward"):
            self._flops.start_profile()
            try:
                yield
            finally:
                self._flops.stop_profile()

    def observe_inputs(self, args: tuple, kwargs: dict) -> None:
        """Count tokens: the first integer tensor of >= 2 dims among the forward's inputs (token ids),
        only its first `curriculum_seqlen` positions per sequence when the kwargs carry one (the
        model truncates to it: the tokens really trained on).

        Forwards in eval mode or under no_grad (validation) are not counted."""
        if self._step_start is None:
            self._step_start = time.perf_counter()
        if not (torch.is_grad_enabled() and self._parts.module.training):
            return
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_floating_point() \
                    and not value.is_complex() and value.dtype != torch.bool:
                self._tokens += tokens_of(value, kwargs.get("curriculum_seqlen"))
                return

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Keep the micro-batch's loss (before division by the accumulation steps) for the step's mean."""
        if self._needs_loss:
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._loss_count += 1

    def after_backward(self) -> None:
        """After each micro-batch's backward: the MoE layers' auxiliary-loss
        check (dsrun/runtime/parallel/expert/watch.py)."""
        self._moe.after_backward()

    # -- per optimizer step ------------------------------------------------------------------
    def end_step(self, grad_norm: float | None) -> None:
        """Report the optimizer step that just ended (call on every rank);
        grad_norm: its global gradient norm before clipping (None: unknown)."""
        parts, state = self._parts, self._parts.state
        now = time.perf_counter()
        interval = now - (self._step_start if self._step_start is not None else now)
        self._step_start = now
        times = self._timers.end_step()
        tokens, self._tokens = self._tokens * parts.topology.world_size, 0
        loss = None
        if self._loss_sum is not None:
            loss = self._loss_sum.item() / self._loss_count  # a device sync, only when a monitor or record needs it
        self._loss_sum, self._loss_count = None, 0
        if self._monitor.enabled:
            peak = self._peak_memory()  # collective: every rank
            moe = self._moe.step_events(state.global_samples, parts.topology.device)  # collective too
            if self._rank0:
                self._monitor.write_events(self._events(times, interval, loss, tokens, peak, grad_norm) + moe)
        if self._breakdown:
            self._period.add(times)
            every = parts.config.steps_per_print
            if every > 0 and state.global_steps % every == 0:
                log_rank0(parts.topology, format_breakdown(self._period, state.global_steps))
                self._period = StepTimes()
                timeline = parts.strategy.offload_timeline()
                if timeline:  # optimizer offload from an accelerator: the last step's copies and CPU Adam
                    log_rank0(parts.topology, format_timeline(timeline))
        if self._flops is not None and not self._flops_done:
            self._print_flops_profile(times)
        if self._records and (now - self._last_record >= _RECORD_INTERVAL_S or state.global_steps == self._total):
            self._last_record = now
            self._emit_record(interval, loss, tokens)
        self._autotuning.end_step(interval, tokens)  # exits after an autotuning trial's last profile step

    def _lr(self) -> float:
        return float(self._parts.optimizer.param_groups[0]["lr"])

    def _events(self, times: StepTimes, interval: float, loss: float | None, tokens: int,
                peak: int, grad_norm: float | None) -> list[tuple[str, float, int]]:
        parts = self._parts
        x = parts.state.global_samples
        out = []
        if loss is not None:
            out.append((events.TRAIN_LOSS, loss, x))
        out.append((events.LR, self._lr(), x))
        if parts.config.fp16.enabled:
            out.append((events.LOSS_SCALE, parts.strategy.loss_scale(), x))
        if grad_norm is not None:
            out.append((events.GRAD_NORM, grad_norm, x))
        out.append((events.SKIPPED_STEPS, parts.state.skipped_steps, x))
        if interval > 0:
            out.append((events.SAMPLES_PER_SEC, parts.config.train_batch_size / interval, x))
            if tokens:
                out.append((events.TOKENS_PER_SEC, tokens / interval, x))
            out.append((events.STEP_TIME_MS, interval * 1e3, x))
        out.append((events.PEAK_MEMORY_BYTES, peak, x))
        out.append((events.COMM_BYTES, times.comm_bytes, x))
        out.append((events.COMM_TIME_MS, times.comm_seconds * 1e3, x))
        if parts.topology.nodes is not None and parts.topology.nodes.num_nodes > 1:
            out.append((events.COMM_INTER_NODE_BYTES, times.comm_inter_node_bytes, x))
        if self._breakdown:
            fwd, bwd, step = (times.phases[p] for p in ("forward", "backward", "step"))
            out += [(events.ELAPSED_MS + "forward", fwd.seconds * 1e3, x),
                    (events.ELAPSED_MS + "backward", bwd.seconds * 1e3, x),
                    (events.ELAPSED_MS + "backward_inner", (bwd.seconds - bwd.comm_seconds) * 1e3, x),
                    (events.ELAPSED_MS + "backward_allreduce", bwd.comm_seconds * 1e3, x),
                    (events.ELAPSED_MS + "step", step.seconds * 1e3, x)]
        return out

    def _peak_memory(self) -> int:
        """The highest peak memory of any rank, bytes (see [Note: peak memory in the monitors])."""
        device = self._parts.topology.device
        cuda = device.type == "cuda"
        profile = self._memory_profile()
        if profile.get("step") == self._parts.state.global_steps and profile.get("phases"):
            key = "cuda_allocated_peak" if cuda else "rss_peak"
            mine = max(r.get(key) or 0 for r in profile["phases"].values())
        else:
            snap = MemorySnapshot.take(device)
            mine = snap.cuda.allocated_peak if cuda else snap.rss_peak
        peak = torch.tensor([float(mine)], dtype=torch.float32, device=device)
        comm.all_reduce(peak, op=comm.ReduceOp.MAX)
        return int(peak.item())

    def _emit_record(self, interval: float, loss: float | None, tokens: int) -> None:
        record: dict[str, Any] = {"step": self._parts.state.global_steps, "lr": self._lr()}
        if self._total:
            record["total"] = self._total
        if loss is not None:
            record["loss"] = loss
        if interval > 0:
            record["samples_per_s"] = self._parts.config.train_batch_size / interval
            if tokens:
                record["tokens_per_s"] = tokens / interval
        sys.stdout.write(encode_record(record) + "\n")
        sys.stdout.flush()

    def _print_flops_profile(self, times: StepTimes) -> None:
        config, cfg = self._parts.config, self._flops_cfg
        gas = config.gradient_accumulation_steps
        timing = {"forward": self._flops.get_total_duration(),
                  "backward": times.phases["backward"].seconds / gas,
                  "step": times.phases["step"].seconds / gas,
                  "batch_size": config.train_micro_batch_size_per_gpu}
        self._flops.print_model_profile(profile_step=cfg.profile_step, module_depth=cfg.module_depth,
                                        top_modules=cfg.top_modules, detailed=cfg.detailed,
                                        output_file=cfg.output_file, step_timing=timing)
        self._flops.end_profile()
        self._flops, self._flops_done = None, True


def _scheduler_total(cfg) -> int | None:
    """Steps the run will take, when the config's LR schedule says (total_num_steps)."""
    if cfg.scheduler is None:
        return None
    total = cfg.scheduler.params.get("total_num_steps")
    return int(total) if isinstance(total, (int, float)) and total > 0 else None

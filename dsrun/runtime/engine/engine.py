"""The training engine: DeepSpeed's engine API over a pluggable gradient strategy.

The engine keeps the loop's bookkeeping -- micro-steps, the gradient
accumulation boundary, `no_sync`, the LR scheduler, step counters and the
progress log -- and delegates everything that depends on the ZeRO stage or
the precision to its `GradientStrategy` (see data_parallel.py). It never
branches on the stage; `build_strategy` is the one place that does.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch

from dsrun.runtime.checkpoint.checkpointer import Checkpointer
from dsrun.runtime.comm import OpStats, comms_logger
from dsrun.runtime.compression import build_compression_strategy, takes_over
from dsrun.runtime.config import DsConfig
from dsrun.runtime.data_pipeline.curriculum import TokenStepLR, check_takes_seqlen, legacy_scheduler
from dsrun.runtime.data_pipeline.data_sampling import CurriculumDataLoader, build_curriculum_loader
from dsrun.runtime.engine.dataloader import DistributedDataLoader
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from dsrun.runtime.data_pipeline.data_routing.helper import bind_random_ltd_layers, random_ltd_scheduler
from dsrun.runtime.strategy.data_parallel import AllReduceStrategy, GradientStrategy
from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.parallel.expert.groups import is_expert_param
from dsrun.runtime.parallel.sequence.model_loss import token_mean_of_model_loss
from dsrun.runtime.engine.compat import DeepSpeedEngineCompat
from dsrun.runtime.engine.compile import CompiledModel, check_settings
from dsrun.runtime.observability import heartbeat
from dsrun.runtime.observability.logging import ProgressLog, log_rank0, logger
from dsrun.runtime.memory.profile import MemoryProfiler, format_memory_profile, no_phase, recorded_phases
from dsrun.runtime.monitor import MonitorMaster
from dsrun.runtime.optim.precision import GradientDivision, cast_floating
from dsrun.runtime.engine.telemetry import StepTelemetry
from dsrun.runtime.engine.train_state import ModelSplit, TrainingParts, TrainState
from dsrun.runtime.zero import build_zero_strategy


def build_strategy(cfg: DsConfig, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   topology: Topology, data_group=None, *, mesh: ParallelMesh,
                   data_axis: str = "data") -> GradientStrategy:
    """The GradientStrategy for the config: the only switch on ZeRO stage and precision.

    Stage 0 in fp32 (fp32 communication) is AllReduceStrategy; everything
    else is built by `dsrun.runtime.zero.build_zero_strategy`, except for
    1-bit optimizers (which own gradient communication) and Lamb on flat
    buffers: `dsrun.runtime.compression.build_compression_strategy`.
    `data_group` is the process group gradients are averaged over (None:
    every rank; a pipeline or a tensor-parallel model passes its mesh's
    data axis): `mesh`'s `data_axis` group ("data", or "sequence_data"
    under sequence parallelism), which ZeRO's MiCS splits into blocks.

    Raises:
        ValueError: a pipeline with a 1-bit optimizer or flat-buffer Lamb.
        ConfigError: as build_compression_strategy raises.
        NotImplementedError: expert (MoE) parameters with a 1-bit optimizer
            (see [Note: expert gradients] in strategy/data_parallel.py and
            [Note: expert partitions] in zero/experts.py).
    """
    zero_path = takes_over(cfg, optimizer) or cfg.zero_optimization.stage > 0 or cfg.fp16.enabled \
        or cfg.bf16.enabled or cfg.communication_data_type not in (None, "fp32")
    if cfg.sparse_gradients and topology.is_rank_zero and zero_path:
        logger.warning("sparse_gradients acts at ZeRO stage 0 in fp32 only (DeepSpeed's ZeRO and 1-bit "
                       "optimizers also reduce every gradient densely); embedding gradients are reduced "
                       "densely in this run")
    if takes_over(cfg, optimizer) and any(is_expert_param(p) for p in module.parameters()):
        raise NotImplementedError(
            "the model has Mixture-of-Experts parameters (allreduce=False), which the 1-bit optimizers and "
            "the flat-buffer Lamb would average over every rank; use Adam/AdamW (any ZeRO stage)")
    if takes_over(cfg, optimizer):
        if mesh.size("pipe") > 1:
            raise ValueError("the 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) and flat-buffer Lamb "
                             "cannot run inside a pipeline yet; use Adam/AdamW")
        return build_compression_strategy(cfg, module, optimizer, topology, group=data_group, mesh=mesh)
    if zero_path:
        return build_zero_strategy(cfg, module, optimizer, topology, group=data_group, mesh=mesh,
                                   data_axis=data_axis)
    return AllReduceStrategy(module, optimizer, topology,
                             bucket_size=cfg.zero_optimization.reduce_bucket_size, group=data_group,
                             division=GradientDivision.from_config(cfg), sparse_gradients=cfg.sparse_gradients,
                             mesh=mesh)


class NonFiniteStepsError(RuntimeError):
    """Too many optimizer steps in a row were skipped for inf/nan gradients
    (config `max_consecutive_nonfinite_steps`); raised on every rank at once."""


def _train_state_counter(name: str) -> property:
    """An engine attribute that reads and writes `engine.train_state.<name>`
    (DeepSpeed's engine has these counters as plain attributes)."""
    return property(lambda self: getattr(self.train_state, name),
                    lambda self, value: setattr(self.train_state, name, value),
                    doc=f"TrainState.{name} of this engine.")


def _describe_loss(loss: Any) -> str:
    if isinstance(loss, (tuple, list)):
        return f"a {type(loss).__name__} of {len(loss)} elements"
    if isinstance(loss, dict):
        return f"a dict with keys {sorted(map(str, loss))[:6]}"
    return f"a {type(loss).__name__}"


class Engine(DeepSpeedEngineCompat, torch.nn.Module):
    """Wraps a model for data-parallel training (DeepSpeed's DeepSpeedEngine API).

    DeepSpeed's query methods (fp16_enabled(), zero_optimization_stage(),
    ...) and attribute forwarding to the wrapped module come from
    DeepSpeedEngineCompat (engine_compat.py).

    Use: `loss = engine(batch)...; engine.backward(loss); engine.step()` once
    per micro-batch. `step()` applies the optimizer only at the gradient
    accumulation boundary (every `gradient_accumulation_steps()` calls) and
    then zeroes gradients itself, as DeepSpeed does.

    Args:
        module: the model (already on `topology.device`, same weights on
            every rank).
        strategy: how gradients are reduced and the optimizer stepped.
        lr_scheduler: object with step()/get_last_lr() (or None), driving
            `strategy.optimizer`.
        config: the resolved DsConfig.
        topology: this rank's Topology.
        mesh: the job's ParallelMesh (the one compose built or adopted),
            kept as `engine.mesh` and handed to the checkpointer.
        split: how the model is split across ranks (a pipeline engine's
            stages, see ModelSplit), for the checkpointer; None: every rank
            holds the whole model.

    Attributes:
        mesh: the job's ParallelMesh. module, optimizer, lr_scheduler, train_state (the counters, also
        readable as DeepSpeed's attributes: global_steps (optimizer steps
        attempted), global_samples (samples consumed by those steps),
        skipped_steps (steps skipped on overflow), micro_steps),
        checkpointer (saves and loads; see dsrun/runtime/checkpoint),
        training_dataloader (the loader initialize built, or None),
        resumed_checkpoint, resumed_client_state (config checkpoint.auto_resume:
        the tag directory initialize loaded and its client_state, else None),
        monitor (dsrun.runtime.monitor.MonitorMaster: the config's
        tensorboard/csv_monitor/wandb outputs; `write_events([(name,
        value, step)])` writes on rank 0),
        curriculum_scheduler_legacy (the `curriculum_learning` section's
        CurriculumScheduler, or None; see [Note: curriculum_seqlen] in
        dsrun/runtime/data_pipeline/curriculum.py),
        random_ltd_scheduler (the kept-token schedule of random-LTD, config
        data_efficiency.data_routing.random_ltd; None when off; updated
        after every optimizer step and saved in checkpoints).

    Memory profiling (config "memory_breakdown": true, or
    `enable_memory_profile()`) measures forward, backward and step as
    phases of dsrun.runtime.memory.profile; `memory_profile()` returns them.
    """

    def __init__(self, module: torch.nn.Module, strategy: GradientStrategy,
                 lr_scheduler: Any, config: DsConfig, topology: Topology, mesh: ParallelMesh,
                 split: ModelSplit | None = None) -> None:
        super().__init__()
        self.mesh = mesh  # the job's parallelism mesh, passed on explicitly (never the process-global one)
        self.module = module
        self.strategy = strategy
        self.optimizer = strategy.optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        self.topology = topology
        self.train_state = TrainState()  # global_steps, global_samples, skipped_steps, micro_steps
        self.training_dataloader = None  # set by initialize(training_data=...); checkpointed
        self.resumed_checkpoint: str | None = None  # set by initialize under checkpoint.auto_resume
        self.resumed_client_state: dict | None = None
        parts = TrainingParts(module, strategy, topology, config, self.train_state, self.mesh, split)
        self.checkpointer = Checkpointer(parts)
        self.curriculum_scheduler_legacy = legacy_scheduler(config)
        if self.curriculum_scheduler_legacy is not None:
            self.register_checkpoint_state("curriculum_learning", self.curriculum_scheduler_legacy)
            if config.curriculum_learning.lr_schedule_in_tokens and lr_scheduler is not None:
                self.lr_scheduler = TokenStepLR(lr_scheduler, self.curriculum_scheduler_legacy)
        self.random_ltd_scheduler = random_ltd_scheduler(config)
        if self.random_ltd_scheduler is not None:
            self.register_checkpoint_state("random_ltd", self.random_ltd_scheduler)
        self._boundary_override: bool | None = None
        self._in_no_sync = False
        self._grad_norm: float | None = None
        self._step_applied = False
        self._consecutive_nonfinite = 0
        self._backward_since_step = False
        self._destroyed = False
        self._compiled: CompiledModel | None = None  # set by compile()
        self._pre_step_hooks: list[Callable[[], None]] = []
        self._step_end_hooks: list[Callable[[int], None]] = []  # called with global_steps after each step
        if self.random_ltd_scheduler is not None:
            self._start_random_ltd()
        self._progress = ProgressLog(topology, config.steps_per_print)
        # monitors, timers, progress records and the flops profile (dsrun/runtime/engine/telemetry.py)
        self.monitor = MonitorMaster(config, topology.rank)
        self._telemetry = StepTelemetry(parts, self.monitor, self.memory_profile)
        # forward/backward/step run their body in self._phase(name): a shared
        # no-op context unless memory profiling is on.
        self._phase = no_phase
        self._memory_profiler: MemoryProfiler | None = None
        self._memory_log = False
        self._memory_profile_kept: dict = {}
        if config.memory_breakdown:
            self.enable_memory_profile()

    def _start_random_ltd(self) -> None:
        """Set the kept-token count of step 0, keep it following the steps,
        and bind the layers `convert_to_random_ltd` already wrapped."""
        self.random_ltd_scheduler.update_seq(self.global_steps)
        self._step_end_hooks.append(self.random_ltd_scheduler.update_seq)
        if any(isinstance(m, RandomLayerTokenDrop) for m in self.module.modules()):
            self.random_ltd_initialize()

    def random_ltd_enabled(self) -> bool:
        """Whether the config turns random-LTD on (data_efficiency.data_routing.random_ltd)."""
        return self.random_ltd_scheduler is not None

    def random_ltd_initialize(self) -> None:
        """Make the model's random-LTD layers that the config lists drop
        tokens on this engine's schedule (`convert_to_random_ltd(engine, ...)`
        calls it; DeepSpeed's method).

        Raises:
            RuntimeError: random-LTD is not enabled in the config.
            ValueError: the model's converted layers are not total_layer_num.
        """
        if self.random_ltd_scheduler is None:
            raise RuntimeError("random-LTD is not enabled in the config: set data_efficiency.enabled, "
                               "data_efficiency.data_routing.enabled and its random_ltd.enabled to true "
                               "and fill in random_ltd's settings")
        bind_random_ltd_layers(self.module, self.random_ltd_scheduler)

    # -- DeepSpeed compatibility: identity of this rank ------------------------------------
    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def global_rank(self) -> int:
        return self.topology.rank

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    # -- DeepSpeed's counter attributes, kept in self.train_state ---------------------------
    global_steps = _train_state_counter("global_steps")
    global_samples = _train_state_counter("global_samples")
    skipped_steps = _train_state_counter("skipped_steps")
    micro_steps = _train_state_counter("micro_steps")

    # -- batch arithmetic ------------------------------------------------------------------
    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward on one rank."""
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step is the last before an optimizer step."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force the boundary decision (None restores the micro-step count rule)."""
        self._boundary_override = is_boundary

    # -- the step --------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """Run the wrapped module's forward. With fp16.auto_cast (and fp16
        on) the floating-point tensors among `inputs`, nested in lists,
        tuples and dicts, are cast to fp16 first; `kwargs` are passed as
        they are, as in DeepSpeed. With the legacy `curriculum_learning`
        section on, a training forward also gets `curriculum_seqlen=`
        (DeepSpeed's keyword; the model truncates its sequences to it).
        Under sequence parallelism a model's `loss` computed from
        `shift_labels` becomes the token mean over the data x sequence ranks
        (dsrun/runtime/parallel/sequence/model_loss.py)."""
        if self.fp16_auto_cast():
            inputs = cast_floating(inputs, torch.float16)
        if self.curriculum_scheduler_legacy is not None and self.module.training:
            if self.global_steps == 0:
                check_takes_seqlen(self.module)
            # DeepSpeed's step numbering: the step this forward belongs to (see [Note: curriculum_seqlen])
            kwargs["curriculum_seqlen"] = self.curriculum_scheduler_legacy.update_difficulty(self.global_steps + 1)
        self._telemetry.observe_inputs(inputs, kwargs)
        heartbeat.beat()  # progress for hung-rank detection: [Note: heartbeats]
        with self._phase("forward"), self._telemetry.phase("forward"):
            output = self.module(*inputs, **kwargs)
        if self.config.sequence_parallel_size > 1:  # [Note: the engine averages a model's loss over tokens]
            output = token_mean_of_model_loss(output, inputs, kwargs, self.mesh.group("sequence_data"))
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward for one micro-batch; gradients are reduced at the boundary.

        Args:
            loss: scalar loss of this micro-batch.
            retain_graph: passed to autograd.
            scale_wrt_gas: divide the loss by gradient_accumulation_steps so
                accumulated gradients are a mean over the whole batch.

        Returns:
            The loss that autograd ran on (divided by G when scale_wrt_gas).

        Raises:
            TypeError: `loss` is not a tensor (e.g. the tuple or dict a
                forward returned): pass the loss element.
            ValueError: `loss` has more than one element, or does not
                require grad (nothing trainable produced it).
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"engine.backward() needs the scalar loss tensor, got {_describe_loss(loss)}; "
                            "when the model's forward returns several outputs, pass the loss, e.g. "
                            "engine.backward(outputs[0]) or engine.backward(outputs['loss'])")
        if loss.numel() != 1:
            raise ValueError(f"engine.backward() needs a scalar loss, got a tensor of shape "
                             f"{tuple(loss.shape)}; reduce it first (e.g. loss.mean())")
        if not loss.requires_grad:
            raise ValueError("engine.backward(): the loss does not require grad, so no trainable "
                             "parameter contributed to it (computed under torch.no_grad(), detached, "
                             "or from frozen parameters only)")
        self._telemetry.observe_loss(loss)
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        sync = self.is_gradient_accumulation_boundary() and not self._in_no_sync
        with self._phase("backward"), self._telemetry.phase("backward"):
            self.strategy.backward(loss, sync=sync, retain_graph=retain_graph)
        self._telemetry.after_backward()  # warns once per MoE layer whose l_aux the loss left out
        self._backward_since_step = True
        return loss

    def step(self) -> None:
        """End one micro-step; at the boundary: clip, optimizer step, LR step, zero grads.

        Raises:
            RuntimeError: called inside `no_sync()` at the boundary (the
                gradients would be stale on other ranks), or with no
                `backward()` since the previous `step()`.
            NonFiniteStepsError: `max_consecutive_nonfinite_steps` steps in
                a row had inf/nan gradients (every rank raises together).
        """
        if not self._backward_since_step:
            raise RuntimeError(
                f"engine.step() without engine.backward() since the previous step() (micro-step "
                f"{self.micro_steps}): call engine.backward(loss) once per micro-batch before step()")
        self._backward_since_step = False
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            if self._in_no_sync:
                raise RuntimeError(
                    "engine.step() at a gradient accumulation boundary inside engine.no_sync(): "
                    "gradients were not reduced; leave no_sync() for the last micro-step")
            self._optimizer_step()
        self.micro_steps += 1

    def register_pre_step_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook()` at every accumulation boundary after the gradients are
        reduced and before the strategy's step (e.g. tensor parallelism's
        gradient sums, dsrun/runtime/engine/model_parallel.py). Every rank
        registers the same hooks in the same order (they may communicate)."""
        self._pre_step_hooks.append(hook)

    def deepspeed_io(self, dataset, batch_size: int | None = None, route: str = "train", pin_memory: bool = True,
                     data_sampler=None, collate_fn: Callable | None = None, num_local_io_workers: int | None = None,
                     difficulty_metrics: dict[str, Callable[[Any], float]] | None = None):
        """A training loader of this rank's micro-batches (DeepSpeed's method),
        made the engine's `training_dataloader` (checkpointed).

        With `data_efficiency` curriculum sampling on, the loader of
        dsrun/runtime/data_pipeline/data_sampling.py: `difficulty_metrics`
        (metric name -> function of a sample returning its difficulty)
        computes the metrics in memory, over every sample once; a metric
        not given uses its config metric_fn. Otherwise a
        DistributedDataLoader over the data axis.

        Raises:
            ValueError: batch_size other than the config's micro-batch,
                data_sampler given (the loader samples itself), or
                difficulty_metrics without curriculum sampling in the config.
        """
        micro = self.train_micro_batch_size_per_gpu()
        if batch_size not in (None, micro):
            raise ValueError(f"deepspeed_io(batch_size={batch_size}): the loader reads micro-batches of "
                             f"train_micro_batch_size_per_gpu={micro}; leave batch_size out")
        if data_sampler is not None:
            raise ValueError("deepspeed_io(data_sampler=...) is not supported: the loader shards the data over "
                             "the data-parallel ranks itself")
        mesh = self.mesh
        if self.config.data_efficiency.curriculum_sampling:
            loader = build_curriculum_loader(dataset, self.config, mesh.rank("data"), mesh.size("data"),
                                             collate_fn, difficulty_metrics)
            self.register_checkpoint_state("data_sampling", loader.sampler)
        elif difficulty_metrics:
            raise ValueError("deepspeed_io(difficulty_metrics=...) needs curriculum sampling on: "
                             "data_efficiency.enabled, data_sampling.enabled and data_sampling."
                             "curriculum_learning.enabled in the config")
        else:
            shard = dataclasses.replace(self.topology, rank=mesh.rank("data"), world_size=mesh.size("data"))
            loader = DistributedDataLoader(dataset, micro, shard, collate_fn=collate_fn,
                                           num_workers=num_local_io_workers or 0)
        self.training_dataloader = loader
        return loader

    def register_checkpoint_state(self, name: str, obj: Any) -> None:
        """Save `obj.state_dict()` (JSON data) under `name` in every checkpoint
        and restore it with `obj.load_state_dict` on load (the curriculum
        schedulers are registered so; a data-routing schedule may be too).

        Raises:
            ValueError: `name` is registered already.
        """
        stateful = self.checkpointer.parts.stateful
        if name in stateful:
            raise ValueError(f"a checkpoint state named {name!r} is registered already; choose another name")
        stateful[name] = obj

    def set_custom_curriculum_learning_schedule(self, schedule: Callable[[int], int] | dict) -> None:
        """The schedule function (step -> difficulty) of curricula whose
        schedule_type is "custom" (DeepSpeed's method).

        Args:
            schedule: a function, for the legacy `curriculum_learning`
                section (and every custom metric of the data sampler); or
                a dict metric name -> function for the data sampler's
                metrics (DeepSpeed's form).

        Raises:
            ValueError: no curriculum of schedule_type "custom" takes it.
        """
        taken = False
        legacy = self.curriculum_scheduler_legacy
        if callable(schedule) and legacy is not None and legacy.state["schedule_type"] == "custom":
            legacy.set_custom_get_difficulty(schedule)
            taken = True
        if isinstance(self.training_dataloader, CurriculumDataLoader):
            taken = self.training_dataloader.sampler.set_custom_curriculum_learning_schedule(schedule) or taken
        if not taken:
            raise ValueError("set_custom_curriculum_learning_schedule: no curriculum has schedule_type 'custom' "
                             "(curriculum_learning, or a metric of data_efficiency.data_sampling."
                             "curriculum_learning with the engine's loader); set schedule_type to custom")

    def _optimizer_step(self) -> None:
        """The accumulation boundary: pre-step hooks, clip, optimizer step, LR
        step, zero grads, counters, progress and telemetry (see `step`)."""
        self.checkpointer.release_pending()  # an async save stops reading what the step changes
        with self._phase("step"), self._telemetry.phase("step"):
            for hook in self._pre_step_hooks:
                hook()
            outcome = self.strategy.step(self.config.gradient_clipping)
            self._grad_norm = outcome.grad_norm
            self._step_applied = outcome.applied
            if outcome.applied:
                self._consecutive_nonfinite = 0
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self.skipped_steps += 1
            self.strategy.zero_grad()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        heartbeat.beat(self.global_steps)
        for hook in self._step_end_hooks:
            hook(self.global_steps)
        if outcome.nonfinite:
            self._on_nonfinite_step(outcome.first_nonfinite)
        self._progress.after_step(self.global_steps, self.skipped_steps,
                                  self.global_samples, self.get_lr(), self.get_mom())
        if self._memory_profiler is not None:
            self._end_memory_step()
        self._telemetry.end_step(self._grad_norm)

    def _on_nonfinite_step(self, first: str | None) -> None:
        """Warn about a step skipped for inf/nan gradients; stop after too many in a row.

        Every rank skips the same steps (the non-finite check is global), so
        every rank raises together and none is left waiting in a collective."""
        self._consecutive_nonfinite += 1
        limit = self.config.max_consecutive_nonfinite_steps
        where = f"first in parameter {first}" if first else "parameter unknown"
        if limit and self._consecutive_nonfinite >= limit:
            raise NonFiniteStepsError(
                f"rank {self.global_rank}: {self._consecutive_nonfinite} optimizer steps in a row "
                f"(steps {self.global_steps + 1 - self._consecutive_nonfinite}-{self.global_steps}) had "
                f"non-finite (inf/nan) gradients ({where}) and were skipped; the loss or the data "
                "produce inf/nan. Lower the learning rate, check the inputs, use gradient_clipping, "
                "or raise max_consecutive_nonfinite_steps in the config (0 = never stop)")
        if self.topology.is_rank_zero:
            logger.warning("step %d: non-finite (inf/nan) gradient (%s); update skipped on every rank "
                           "(%d in a row%s)", self.global_steps, where, self._consecutive_nonfinite,
                           f"; the run stops at {limit}" if limit else "")

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.strategy.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally and send nothing.

        Raises:
            RuntimeError: nested no_sync().
        """
        if self._in_no_sync:
            raise RuntimeError("engine.no_sync() is already active; do not nest it")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # -- queries -----------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        """Current learning rate of each optimizer parameter group."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Momentum of each group: Adam-style `betas` or SGD `momentum` (None if neither)."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of all gradients at the last optimizer step, before clipping."""
        return self._grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last `step()` call updated the parameters."""
        return self._step_applied

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds for parameters, gradients, master weights and
        optimizer states, per dtype (see dsrun.estimate_zero_memory)."""
        return self.strategy.memory_breakdown()

    # -- memory profile ----------------------------------------------------------------------
    def enable_memory_profile(self, detailed: bool = False, log: bool | None = None) -> None:
        """Measure memory in every forward, backward and step from now on.

        Args:
            detailed: also track the tensors each phase creates, to find
                transient copies (slows every op; see
                dsrun.runtime.memory.profile [Note: tracking new tensors]).
            log: print the table on rank 0 every `steps_per_print` steps;
                None: when the config sets "memory_breakdown".

        Phases already recorded are dropped. The "initialize" row exists only
        when the config set "memory_breakdown" (or when initialize ran inside
        `dsrun.runtime.memory.profile.phase("initialize")`).
        """
        self._memory_profiler = MemoryProfiler(self.device, self.strategy.memory_breakdown,
                                               detailed=detailed)
        self._phase = self._memory_profiler.phase
        self._memory_log = self.config.memory_breakdown if log is None else log

    def disable_memory_profile(self) -> None:
        """Stop measuring; `memory_profile()` keeps returning the last profile."""
        if self._memory_profiler is not None:
            self._memory_profile_kept = self.memory_profile()
        self._memory_profiler, self._phase = None, no_phase

    def memory_profile(self) -> dict:
        """This rank's measured memory per phase of the last optimizer step (bytes).

        Returns:
            A JSON-serialisable dict: {"rank", "step" (the global step the
            phases belong to; None before the first step ends),
            "rss_source", "detailed", "phases": {name: record}}, where the
            phases recorded outside the step by
            `dsrun.runtime.memory.profile.phase` ("construction",
            "initialize") come first, then "forward", "backward", "step".
            Each record's fields are described by
            dsrun.runtime.memory.profile.PhaseRecord. Empty when profiling
            was never enabled. `dsrun.runtime.memory.profile.format_memory_profile`
            renders it as a table.
        """
        if self._memory_profiler is None:
            return self._memory_profile_kept
        profile = self._memory_profiler.profile()
        profile["phases"] = {**recorded_phases(), **profile["phases"]}
        return {"rank": self.global_rank, **profile}

    def offload_timeline(self) -> dict:
        """The last optimizer step's offload timeline: device time of the
        gradient (device->host) and parameter (host->device) copies, the
        host gradient work, the CPU Adam and the waits, as totals (ms, bytes,
        count per kind) and intervals (kind, start ms, end ms) from the start
        of backward; see dsrun/runtime/offload/transfer.py. Empty unless the
        optimizer is offloaded from an accelerator. Printed with
        `wall_clock_breakdown`; `dsrun.runtime.offload.transfer.format_timeline`
        renders it."""
        return self.strategy.offload_timeline()

    def _end_memory_step(self) -> None:
        self._memory_profiler.end_step(self.global_steps)
        every = self.config.steps_per_print
        if self._memory_log and every > 0 and self.global_steps % every == 0:
            log_rank0(self.topology, format_memory_profile(self.memory_profile()))

    def comm_stats(self) -> dict[str, OpStats]:
        """Collective counters of this process (calls/elements/bytes per op name)."""
        return comms_logger.snapshot()

    # -- torch.compile (dsrun/runtime/engine/compile.py) ------------------------------------
    def compile(self, backend: str | Callable = "inductor", compile_kwargs: dict | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """Compile the wrapped module with torch.compile, in place (DeepSpeed's method).

        Works at every ZeRO stage: at stage 3 the gather/release hooks run
        eagerly between graphs ([Note: compiling under ZeRO hooks] in
        dsrun/runtime/engine/compile.py). Compilation happens at the next
        forward; state_dict keys and checkpoints are unchanged. Calling it
        again with the same arguments does nothing; with others, the module
        is compiled again with those.

        Args:
            backend: a name from `torch._dynamo.list_backends()` ("inductor",
                "aot_eager", "eager", ...) or a callable backend.
            compile_kwargs: further torch.compile arguments (fullgraph,
                dynamic, mode, options, disable).
            schedule: DeepCompile's pass schedule: ignored with a warning
                (dsrun has no DeepCompile).
            compiled_autograd_enabled: must stay False.

        Raises:
            ValueError, TypeError, NotImplementedError: bad arguments, before
                anything is compiled (see compile.py `check_settings`).
        """
        regions = self.strategy.hooks.hooked_modules if self.strategy.hooks is not None else []
        settings = check_settings(backend, compile_kwargs, len(regions), schedule, compiled_autograd_enabled)
        if self._compiled is not None:
            if self._compiled.settings.same_as(settings):
                return
            self._compiled.undo()
        self._compiled = CompiledModel(self.module, settings, list(regions))

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` compiled the wrapped module (DeepSpeed's property)."""
        return self._compiled is not None

    # -- checkpoints (dsrun.runtime.checkpoint) -----------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save the full training state under save_dir/<tag>/ (call on every rank).

        Every rank writes its own shard in parallel; the tag is committed
        (index.json, then `latest`) only once all succeeded, so a crash
        leaves the previous checkpoint intact. Loadable on any world size,
        stage and precision. With config `checkpoint.async_save` it returns
        at once and a background thread writes (the next optimizer step
        first copies what it has not written yet); `wait_checkpoint()` (or
        the next save/load) waits for the write and raises its error.

        save_dir and tag are collective arguments: when ranks pass
        different ones, rank 0's are used on every rank and rank 0 logs one
        warning naming the others' (an error on every rank, before anything
        is written, under DSRUN_STRICT_CONFIG=1 or config
        `checkpoint.strict_paths`).

        Args:
            tag: directory name; default "global_step<global_steps>".
            client_state: JSON-able dict (tensors inside are stored as
                tensors) returned by load_checkpoint. Only rank 0's is
                saved; what other ranks pass is ignored.
            save_latest: point save_dir/latest at this tag.
            exclude_frozen_parameters: leave parameters with
                requires_grad=False out.

        Returns:
            True (DeepSpeed's return value).

        Raises:
            dsrun.runtime.checkpoint.CheckpointError: on every rank, when any
                rank failed, a state is not JSON-able, not every rank called,
                or ranks passed different save_dir/tag under strict checking.
        """
        self.checkpointer.save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                               lr_scheduler=self.lr_scheduler, dataloader=self.training_dataloader)
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Load a checkpoint saved by save_checkpoint (call on every rank).

        tag None: the tag in load_dir/latest, else the newest complete one
        (incomplete tags are skipped and named in a warning). load_dir and
        tag are agreed as in save_checkpoint (rank 0's are used).

        Returns:
            (path of the tag directory, client_state), or (None, None) when
            load_dir holds no complete checkpoint.

        Raises:
            dsrun.runtime.checkpoint.CheckpointError: naming the file or key
                (missing/incomplete tag, corrupted file, another model), or
                the ranks that passed another load_dir/tag under strict
                checking.
        """
        return self.checkpointer.load(load_dir, tag, load_module_strict, load_optimizer_states,
                                      load_lr_scheduler_states, load_module_only,
                                      lr_scheduler=self.lr_scheduler, dataloader=self.training_dataloader)

    def wait_checkpoint(self) -> None:
        """Block until a running asynchronous save (config checkpoint.async_save)
        is committed. Raises CheckpointError if it failed (save, load and
        save_16bit_model call this first)."""
        self.checkpointer.wait_pending()

    def destroy(self) -> None:
        """Undo what the engine did to the model: wait for an asynchronous
        save (raising its CheckpointError, as `wait_checkpoint`), then remove
        every hook the strategy registered and stop its threads and swap
        files (`GradientStrategy.close`; [Note: strategy hooks] in
        dsrun/runtime/strategy/hooks.py), and close the monitors (TensorBoard
        files flushed and closed, the wandb run finished). The engine cannot
        train afterwards. At
        stages 0-2 the module then runs as a plain module with the trained
        weights; at stage 3 its parameters stay partitioned (DeepSpeed's
        `destroy` leaves them so too): gather what you need first
        (`save_16bit_model`, `GatheredParameters`). Calling it again does nothing.
        """
        if self._destroyed:
            return
        self._destroyed = True
        try:
            self.checkpointer.wait_pending()
        finally:
            try:
                self.strategy.close()
            finally:
                self.monitor.close()

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the full model in the compute dtype as one safetensors file
        from rank 0 (call on every rank); loadable with
        `safetensors.torch.load_file` / `model.load_state_dict`. A "*.bin"
        name becomes "*.safetensors" (with a warning): dsrun writes no
        pickles. Returns True. Raises CheckpointError when rank 0 cannot write."""
        self.checkpointer.save_16bit(save_dir, save_filename, exclude_frozen_parameters)
        return True


DeepSpeedEngine = Engine  # DeepSpeed's name (`deepspeed.runtime.engine.DeepSpeedEngine`, used by Hugging Face)

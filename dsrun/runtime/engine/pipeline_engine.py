"""The pipeline engine: DeepSpeed's `PipelineEngine` (`train_batch`,
`eval_batch`) as one executor of the schedules in runtime/parallel/pipe/schedule.py.

[Note: one executor, schedules as data]
`train_batch` asks pipe/schedule.py for this rank's list of actions and runs them
in order; nothing here knows which schedule it runs. Per micro-batch and
chunk it keeps the stage input (received, or loaded on the first stage), the
stage output (kept for the backward) and the gradient received for it; a
backward frees them. A new schedule is a new list, not new engine code.

[Note: gradients through the strategy]
Every backward goes through the engine's `GradientStrategy` (ZeRO stage 0
to 3 over the mesh's data axis; stage 3 gathers each layer's parameters
inside the forward and backward actions, see zero/stage3.py [Note: hooks]), so
gradient accumulation, loss scaling and the data-parallel reduction are
the data-parallel engine's. The last stage
runs `strategy.backward(loss / m)`. Another stage has no loss: it runs the
strategy's backward on the scalar sum over its outputs of
`(output * received_grad).sum() / loss_scale`, whose gradient with respect
to each output is the received gradient exactly (the received gradients
already carry the loss scale, which the strategy multiplies back). The
backward that completes this rank's last micro-batch passes `sync=True`, so
the data-parallel reduction overlaps it as in data-parallel training; the
schedule's `ReduceTiedGrads` then sums the gradients of weights tied across
stages (after the data-parallel average, which gives the same sum), and
`OptimizerStep` is the data-parallel engine's step, whose norm and overflow
check span every stage and tensor-parallel rank (`StageSpan`, set by
initialize through dsrun/runtime/engine/model_parallel.py).

[Note: the step's end]
Every rank returns the step's loss (the last stage's mean over its
micro-batches and its replicas), and the step needs the gradient norm over
all stages (clipping and the non-finite check skip or scale alike on every
stage). DeepSpeed's PipelineEngine computes no norm in fp32 without
clipping and broadcasts the loss after its step; dsrun needs the norm for
its non-finite check, so the two travel together: the last stage starts
the all-reduce of its mean loss over its replicas (asynchronously) right
after its last forward, so that it overlaps the remaining backwards; at
OptimizerStep the loss (zero on every other stage) is added to the
strategy's all-reduce of the squared norm over the stages
(`GradientStrategy.add_to_stage_sum`), and the sum, the last stage's value
exactly (x + 0 = x), is read back by a step-end hook before the telemetry
reports the step. One collective over the stages per step, not two (a
broadcast, then the norm's all-reduce). When the norm's group is not the
pipe axis alone (tensor parallelism: it spans pipe x model), the loss is
broadcast over the pipe axis before the step, as before.

[Note: zero bubble's split backward]
`BackwardInput` (B) must produce the stage input's gradient, which the
previous stage waits for, without the weight gradients; `BackwardWeight`
(W) later produces only the weight gradients (Qi et al., ICLR 2024). During
the forward of a zero-bubble schedule a forward hook (run before any other
forward hook of the module) records the input and output of every module
that owns parameters. B then asks autograd for the gradients of the stage
input AND of those module outputs in one `torch.autograd.grad` call: that
is the input pass, and it computes no weight gradient. W computes, for each
recorded module that pipe/weight_grad.py has a rule for (Linear, LayerNorm,
Embedding), its parameters' gradients from its input and output gradient
([Note: weight pass by rule]), and hands all of them to ONE
`torch.autograd.backward(parameters, gradients)` (one autograd call per
micro-batch, not per module), inside the strategy's `run_backward` (so
gradient accumulation, hooks and the data-parallel reduction are the usual
ones; the gradients already carry the loss scale). On an accelerator
(`release_graph_in_input_pass`, on by default off the CPU),
when every recorded module has a rule and they cover all the chunk's
parameters, B does not keep the graph: it frees the stage's activations at
once and W holds only the modules' inputs (which the forward saved anyway)
and output gradients. On the CPU B keeps the graph until W: freed early,
its memory went back to the OS and W's allocations faulted it in again
(2.7x the page faults and about 5% more CPU time per step on the one-stage
bench-v256 GPT), while a GPU's caching allocator keeps it. Without rules
for all, B keeps the graph, and W runs, for each module without a rule,
`torch.autograd.backward(output, its gradient, inputs=<its own
parameters>)` (only that module's weight-gradient ops); a parameter that no
recorded output covers (used outside a module's forward, e.g. a tied
weight's `forward_fn`, or under reentrant activation checkpointing, or an
output or input changed in place) gets its gradient in W from the stage's
root restricted to those parameters, which recomputes the activation
gradients on its path: correct, only slower.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from dsrun.runtime import comm
from dsrun.runtime.config import ConfigError
from dsrun.runtime.data_pipeline.curriculum import truncate_sequence
from dsrun.runtime.engine.engine import Engine
from dsrun.runtime.engine.train_state import ModelSplit
from dsrun.runtime.parallel.grid import PipelineParallelGrid
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.parallel.pipe import schedule as sched
from dsrun.runtime.parallel.pipe.module import PipelineModule
from dsrun.runtime.parallel.pipe.p2p import StageLink, as_tensors
from dsrun.runtime.parallel.pipe.timing import ActionTimer
from dsrun.runtime.parallel.pipe.weight_grad import has_rule, weight_grads
from dsrun.runtime.zero.groups import RankGroup


@dataclass
class _Buffers:
    """What one step keeps per (micro_batch, chunk) between its actions."""

    inputs: dict = field(default_factory=dict)   # stage input tensors (leaves on later stages)
    labels: dict = field(default_factory=dict)   # micro_batch -> labels (last stage)
    outputs: dict = field(default_factory=dict)  # stage outputs (or the loss on the last stage)
    grads: dict = field(default_factory=dict)    # received gradients of the outputs
    input_grads: dict = field(default_factory=dict)  # gradients of the inputs, to send
    captured: dict = field(default_factory=dict)  # zero bubble: (module, output, version) recorded in forward
    weight_work: dict = field(default_factory=dict)  # zero bubble: what B left for W (see the Note)
    losses: list = field(default_factory=list)   # detached losses (last stage)
    step_loss: tuple | None = None  # (mean loss, its replica all-reduce handle): see [Note: the step's end]
    logits: list = field(default_factory=list)   # last stage outputs (eval_batch with return_logits)


def _tensors_requiring_grad(value) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in as_tensors(value, "a pipeline stage output") if t.requires_grad)


class PipelineEngine(Engine):
    """Trains a `PipelineModule` over the mesh's pipe x data axes
    (DeepSpeed's `deepspeed.runtime.pipe.engine.PipelineEngine`).

    Use `train_batch()` (one optimizer step over `gradient_accumulation_steps`
    micro-batches) and `eval_batch()`; `forward`/`backward`/`step` of the
    data-parallel engine are not available (DeepSpeed raises too).

    Args:
        module: the PipelineModule (this rank's layers, on the device).
        strategy: the GradientStrategy over the mesh's data axis.
        lr_scheduler, config, topology: as `Engine`.
        mesh: the job's ParallelMesh (its pipe axis matches the module's stages).
        tied: what `tie_weights` returned.

    Attributes:
        grid: the `PipelineParallelGrid` of the mesh (DeepSpeed's `engine.grid`).
        num_stages, stage_id, micro_batches, schedule_name, virtual_stages.
        last_bubble: this rank's wait on its neighbours during the last
            `train_batch` ("wait_s", seconds blocked in receives and send
            completion) and the schedule's wall time before the optimizer
            step ("schedule_s"); their ratio is the stage's measured bubble.
        release_graph_in_input_pass: zb-h1 only: whether B frees the graph
            when the weight pass does not need it (default: off on the CPU,
            on elsewhere; see [Note: zero bubble's split backward]).
        action_timing: set True to time every action of `train_batch`
            (off by default); the table of the last such step is then in
            `last_action_times` (see [Note: per-action timing] in pipe/timing.py).
    """

    def __init__(self, module: PipelineModule, strategy, lr_scheduler, config, topology,
                 mesh: ParallelMesh, tied: TiedGroups) -> None:
        super().__init__(module, strategy, lr_scheduler, config, topology, mesh, split=_model_split(module, mesh))
        self.grid = PipelineParallelGrid(mesh=mesh)
        self.num_stages = module.num_stages
        self.stage_id = module.stage_id
        self.virtual_stages = module.virtual_stages
        self.micro_batches = config.gradient_accumulation_steps
        self.schedule_name = config.pipeline.schedule
        self._link = StageLink(topology.device)
        self._data_iterator: Iterator | None = None
        self._batch_fn: Callable | None = None
        self._curriculum_seqlen: int | None = None  # this train_batch's; see [Note: curriculum_seqlen]
        self._tied_groups = tied
        self.agg_train_loss: torch.Tensor | None = None
        self._capturing: list | None = None  # zero bubble: module outputs recorded by the forward hooks
        self.release_graph_in_input_pass = self.device.type != "cpu"  # see [Note: zero bubble's split backward]
        self._capture_hooks = []
        if self.schedule_name == "zb-h1":
            for m in module.modules():
                if any(p.requires_grad for p in m.parameters(recurse=False)):
                    # prepend: the output recorded is the module's own, before other hooks change it
                    self._capture_hooks.append(m.register_forward_hook(self._record_output, prepend=True))
        # The last train_batch's wait on neighbours ("wait_s": receives and send
        # completion) and the schedule's wall time before the step ("schedule_s").
        self.last_bubble: dict[str, float] = {}
        self.action_timing = False
        self.last_action_times: dict[str, dict[str, float]] = {}
        self._timer: ActionTimer | None = None
        self._plans: dict[tuple[str, int], tuple[list, int]] = {}  # see _training_plan
        self._peers: dict[tuple[type, int], int] = {}  # see _peer
        self._params_of_chunk: dict[int, list[torch.nn.Parameter]] = {}  # see _chunk_params
        self._loss_in_norm = False  # this step's loss rides the norm's all-reduce ([Note: the step's end])
        self._step_end_hooks.insert(0, self._loss_from_norm)

    # -- DeepSpeed's pipeline API ---------------------------------------------------------
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first stage (it reads the inputs)."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage (it reads the labels and computes the loss)."""
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator `train_batch`/`eval_batch` read micro-batches from when given none."""
        self._data_iterator = iterator

    def set_batch_fn(self, fn: Callable) -> None:
        """A function applied to every micro-batch read from the iterator."""
        self._batch_fn = fn

    def reset_activation_shape(self) -> None:
        """Kept for DeepSpeed scripts: shapes are exchanged whenever they
        change (see pipe/p2p.py [Note: tensor metadata per micro-batch])."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelineEngine trains with engine.train_batch() and evaluates with "
                           "engine.eval_batch(); forward/backward/step are the data-parallel engine's")

    backward = step = forward

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches.

        Only the first stage (inputs) and the last (labels) read from the
        iterator; each micro-batch is `(inputs, labels)`, inputs a tensor or
        tuple of tensors (floating-point ones are cast to the bf16/fp16
        compute dtype under mixed precision, as DeepSpeed's pipeline does).

        With the legacy `curriculum_learning` section on, every tensor of
        two or more dimensions of the micro-batch's inputs and labels is
        truncated to `[:, :curriculum_seqlen]` first (see [Note:
        curriculum_seqlen] in dsrun/runtime/data_pipeline/curriculum.py).

        Returns:
            The mean loss of the step's micro-batches, averaged over the
            data-parallel ranks, on every rank (a 0-dim fp32 tensor).

        Raises:
            RuntimeError: no data iterator (pass one or call set_dataiterator).
        """
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self._require_iterator()
        self.module.train()
        if self.curriculum_scheduler_legacy is not None:
            self._curriculum_seqlen = self.curriculum_scheduler_legacy.update_difficulty(self.global_steps + 1)
        actions, last_backward = self._training_plan()
        buffers = _Buffers()
        self._link.reset_wait()
        self._timer = timer = ActionTimer(self._link) if self.action_timing else None
        run = self._run
        started = time.perf_counter()
        for i, action in enumerate(actions):
            if type(action) is sched.ReduceTiedGrads:  # the schedule's part ends; the step follows
                self.last_bubble = {"wait_s": self._link.wait_seconds, "schedule_s": time.perf_counter() - started}
            if timer is None:
                run(action, buffers, True, i == last_backward)
            else:
                timer.run(action, lambda: run(action, buffers, True, i == last_backward))
        if timer is not None:
            self.last_action_times, self._timer = timer.result(), None
        self.micro_steps += self.micro_batches
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None):
        """Forward only over `num_micro_batches` (default
        gradient_accumulation_steps) micro-batches of `data_iter`.

        Returns:
            The loss reduced per `reduce_output` ("avg": the mean over
            micro-batches and data-parallel ranks; None: the list of
            per-micro-batch losses of this rank), broadcast to every stage
            when `bcast_loss` (else only the last stage's is meaningful);
            with `return_logits`, `(loss, logits)` where logits are the last
            stage's outputs of each micro-batch (None on other stages).

        Raises:
            ValueError: reduce_output is not "avg" or None.
        """
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        self.set_dataiterator(data_iter)
        self.module.eval()
        m = num_micro_batches or self.micro_batches
        buffers = _Buffers()
        self._curriculum_seqlen = None  # evaluation reads whole sequences, as DeepSpeed's
        with torch.no_grad():
            for action in self._inference_actions(m):
                self._run(action, buffers, train=False, compute_loss=compute_loss)
        self._link.wait_sends()
        self.module.train()
        losses = buffers.losses if compute_loss else []
        loss = self._aggregate_loss(losses, bcast=bcast_loss, reduce=reduce_output) if compute_loss else None
        if return_logits:
            return loss, (buffers.logits if self.is_last_stage() else None)
        return loss

    # -- the executor ----------------------------------------------------------------------
    def _inference_actions(self, num_micro_batches: int) -> list:
        """Forward-only actions: the inference schedule, or with chunks the
        interleaved schedule's forward actions in its order (dropping the
        backward ones can only make a receive's send come earlier)."""
        if self.virtual_stages == 1:
            return sched.inference_schedule(self.num_stages, self.stage_id, num_micro_batches)
        forward = (sched.LoadMicroBatch, sched.RecvActivation, sched.Forward, sched.SendActivation)
        return [a for a in sched.build_schedule("interleaved", self.num_stages, self.stage_id, num_micro_batches,
                                                self.virtual_stages) if isinstance(a, forward)]

    def _require_iterator(self) -> None:
        if self._data_iterator is None and (self.is_first_stage() or self.is_last_stage()):
            raise RuntimeError("train_batch() has no data: pass an iterator (engine.train_batch(iter(loader))), "
                               "call engine.set_dataiterator(...), or give initialize(training_data=...)")

    def _training_plan(self) -> tuple[list, int]:
        """This rank's training actions for the current micro-batch count and
        the index of its last backward (built once per count: the schedule
        depends on nothing else)."""
        key = (self.schedule_name, self.micro_batches)
        plan = self._plans.get(key)
        if plan is None:
            actions = sched.build_schedule(self.schedule_name, self.num_stages, self.stage_id,
                                           self.micro_batches, self.virtual_stages)
            last_backward = max(i for i, a in enumerate(actions)
                                if isinstance(a, (sched.Backward, sched.BackwardWeight)))
            plan = self._plans[key] = (actions, last_backward)
        return plan

    def _run(self, action, buffers: _Buffers, train: bool, sync: bool = False, compute_loss: bool = True) -> None:
        """Execute one action (see [Note: the action contract] in pipe/schedule.py)."""
        kind = type(action)
        if kind is sched.Forward:
            self._forward(action, buffers, train, compute_loss)
        elif kind is sched.RecvActivation:
            buffers.inputs[(action.micro_batch, action.chunk)] = self._link.recv_activations(self._peer(action))
        elif kind is sched.SendActivation:
            key = (action.micro_batch, action.chunk)
            self._link.send_activations(buffers.outputs[key] if train else buffers.outputs.pop(key),
                                        self._peer(action))
        elif kind is sched.RecvGrad:
            key = (action.micro_batch, action.chunk)
            like = _tensors_requiring_grad(buffers.outputs[key])
            buffers.grads[key] = self._link.recv_gradients(like, self._peer(action))
        elif kind is sched.Backward:
            self._backward_input((action.micro_batch, action.chunk), buffers, keep_graph=False, weights=True,
                                 sync=sync)
        elif kind is sched.SendGrad:
            self._link.send_gradients(buffers.input_grads.pop((action.micro_batch, action.chunk)),
                                      self._peer(action))
        elif kind is sched.LoadMicroBatch:
            self._load(action, buffers)
        elif kind is sched.BackwardInput:
            self._backward_input((action.micro_batch, action.chunk), buffers, keep_graph=True, weights=False,
                                 sync=False)
        elif kind is sched.BackwardWeight:
            self._backward_weight((action.micro_batch, action.chunk), buffers, sync)
        elif kind in (sched.ReduceTiedGrads, sched.ReduceGrads, sched.OptimizerStep):
            self._run_step_end(kind, buffers)
        else:
            raise TypeError(f"the pipeline executor has no rule for {action!r}")

    def _peer(self, action) -> int:
        """The global rank a send or receive talks to (cached per kind and chunk)."""
        key = (type(action), action.chunk)
        found = self._peers.get(key)
        if found is None:
            stage, _ = sched.peer(action, self.num_stages, self.stage_id, self.virtual_stages)
            found = self._peers[key] = self.mesh.stage_to_global(stage)
        return found

    def _next_batch(self):
        batch = next(self._data_iterator)
        return self._batch_fn(batch) if self._batch_fn is not None else batch

    def _load(self, action, buffers: _Buffers) -> None:
        batch = self._next_batch()
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(f"a pipeline micro-batch must be (inputs, labels), got {type(batch).__name__}"
                            + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
                            + "; return such pairs from the data iterator or set_batch_fn")
        inputs, labels = batch
        if self._curriculum_seqlen is not None:
            inputs = truncate_sequence(inputs, self._curriculum_seqlen)
            labels = truncate_sequence(labels, self._curriculum_seqlen)
        if self.module.is_first_stage(action.chunk):
            buffers.inputs[(action.micro_batch, action.chunk)] = _to_device(inputs, self.device,
                                                                            self.strategy.compute_dtype)
        if self.module.is_last_stage(action.chunk):
            buffers.labels[action.micro_batch] = _to_device(labels, self.device)

    def _forward(self, action, buffers: _Buffers, train: bool, compute_loss: bool) -> None:
        key = (action.micro_batch, action.chunk)
        inputs = buffers.inputs[key] if train else buffers.inputs.pop(key)
        if isinstance(inputs, tuple) and len(inputs) == 1:
            inputs = inputs[0]
        self._capturing = [] if train and self._capture_hooks else None
        timer = self._timer
        begun = time.perf_counter() if timer is not None else 0.0
        with self._telemetry.phase("forward"):
            out = self.module(inputs, chunk=action.chunk)
        if self._capturing is not None:
            buffers.captured[key], self._capturing = self._capturing, None
        last = self.module.is_last_stage(action.chunk)
        if last:
            if (not train and not compute_loss) or self.module.loss_fn is None:
                loss = out
            else:
                loss = self.module.loss_fn(out, buffers.labels.pop(action.micro_batch))
        if timer is not None:
            timer.add_compute(time.perf_counter() - begun)
        if last:
            if not train:
                buffers.logits.append(out)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                buffers.losses.append(loss.detach().float().reshape(()))
                if train and len(buffers.losses) == self.micro_batches:
                    buffers.step_loss = self._start_replica_mean(buffers.losses)
            out = loss
        buffers.outputs[key] = out

    def _surrogate(self, key, buffers: _Buffers) -> torch.Tensor:
        """The scalar whose backward through the strategy gives this chunk's
        gradients (see [Note: gradients through the strategy])."""
        out = buffers.outputs[key]
        if key not in buffers.grads:  # the last stage: the loss, averaged over the micro-batches
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise TypeError("the last pipeline stage must produce a scalar loss (give PipelineModule "
                                "a loss_fn, or return the loss from the last layer)")
            return out / self.micro_batches
        total = sum((o.float() * g.float()).sum() for o, g in zip(_tensors_requiring_grad(out), buffers.grads[key]))
        return total / self.strategy.loss_scale()

    def _record_output(self, module, args, output) -> None:
        if self._capturing is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            x = args[0] if len(args) == 1 and isinstance(args[0], torch.Tensor) and has_rule(module) else None
            self._capturing.append((module, x, x._version if x is not None else 0, output, output._version))

    def _backward_input(self, key, buffers: _Buffers, keep_graph: bool, weights: bool, sync: bool) -> None:
        inputs = buffers.inputs.get(key, ())
        leaves = [t for t in (inputs if isinstance(inputs, tuple) else (inputs,))
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        timer = self._timer
        begun = time.perf_counter() if timer is not None else 0.0
        with self._telemetry.phase("backward"):
            if weights:
                self.strategy.backward(self._surrogate(key, buffers), sync=sync, retain_graph=False)
                grads = [t.grad for t in leaves]
                keep = False
            else:  # B of [Note: zero bubble's split backward]
                root = self._surrogate(key, buffers) * self.strategy.loss_scale()
                # (module, its input when a rule covers it, else None, its version, its output),
                # the output unchanged since the forward
                recorded = [(m, x if x is not None and x._version == xv else None, xv, o)
                            for m, x, xv, o, ov in buffers.captured.pop(key, []) if o._version == ov]
                covered = {id(p) for m, *_ in recorded for p in m.parameters(recurse=False)}
                uncovered = [p for p in self._chunk_params(key[1]) if p.requires_grad and id(p) not in covered]
                # W needs the graph, or the host allocator would fault its memory back in (see the Note)
                keep = (bool(uncovered) or any(x is None for _, x, _, _ in recorded)
                        or not self.release_graph_in_input_pass)
                targets = leaves + [o for *_, o in recorded]
                found = (torch.autograd.grad(root, targets, retain_graph=keep, allow_unused=True)
                         if targets else ())
                grads = list(found[:len(leaves)])
                work = [(m, x, xv, o if x is None else None, g)
                        for (m, x, xv, o), g in zip(recorded, found[len(leaves):]) if g is not None]
                buffers.weight_work[key] = (root if keep else None, work, uncovered)
        if timer is not None:
            timer.add_compute(time.perf_counter() - begun)
        if leaves:
            buffers.input_grads[key] = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]
        if not keep:
            self._free(key, buffers)  # W needs only the module inputs and output gradients of `work`

    def _backward_weight(self, key, buffers: _Buffers, sync: bool) -> None:
        """W of [Note: zero bubble's split backward]."""
        root, work, uncovered = buffers.weight_work.pop(key)

        def weight_pass() -> None:
            params, grads = [], []
            for m, x, version, output, grad in work:
                if x is None:
                    own = [p for p in m.parameters(recurse=False) if p.requires_grad]
                    torch.autograd.backward(output, grad, inputs=own, retain_graph=True)
                elif x._version != version:
                    raise RuntimeError(f"zero bubble weight pass: the input of {type(m).__name__} (micro-batch "
                                       f"{key[0]}, chunk {key[1]}) was modified in place after its forward; "
                                       "the weight gradient needs it unchanged until the weight pass (clone it "
                                       "before changing it, or use schedule 1f1b)")
                else:
                    for p, g in weight_grads(m, x, grad):
                        params.append(p)
                        grads.append(g)
            if params:  # one autograd call accumulates them all (hooks and reduction as usual)
                torch.autograd.backward(params, grads)
            if uncovered:
                torch.autograd.backward(root, inputs=uncovered, retain_graph=True)

        begun = time.perf_counter()
        with self._telemetry.phase("backward"):
            self.strategy.run_backward(weight_pass, sync=sync)
        if self._timer is not None:
            self._timer.add_compute(time.perf_counter() - begun)
        self._free(key, buffers)

    def _chunk_params(self, chunk: int) -> list[torch.nn.Parameter]:
        """The parameters the layers of this rank's `chunk` use (a tied
        layer's module through its forward_fn partial), each once; found on
        the first call per chunk (the layers and their parameters are fixed
        once the engine is built)."""
        found = self._params_of_chunk.get(chunk)
        if found is None:
            params: dict[int, torch.nn.Parameter] = {}
            for _, layer in self.module.local_layers(chunk):
                owners = [layer] if isinstance(layer, torch.nn.Module) else \
                    [a for a in getattr(layer, "args", ()) if isinstance(a, torch.nn.Module)]
                for owner in owners:
                    params.update((id(p), p) for p in owner.parameters())
            found = self._params_of_chunk[chunk] = list(params.values())
        return found

    def destroy(self) -> None:
        """As `Engine.destroy`, also removing the zero-bubble forward hooks."""
        for handle in self._capture_hooks:
            handle.remove()
        self._capture_hooks.clear()
        super().destroy()

    @staticmethod
    def _free(key, buffers: _Buffers) -> None:
        for store in (buffers.inputs, buffers.outputs, buffers.grads, buffers.captured):
            store.pop(key, None)

    def _run_step_end(self, kind, buffers: _Buffers) -> None:
        if kind is sched.ReduceTiedGrads:
            for params, group in self._tied_groups:
                self.strategy.sum_gradients_across(params, group)
        elif kind is sched.ReduceGrads:
            self._link.wait_sends()  # the data-parallel reduction ran inside the last backward
        else:  # see [Note: the step's end]
            value = self._finish_replica_mean(buffers.step_loss or self._start_replica_mean(buffers.losses))
            stages = self.strategy.stages
            self._loss_in_norm = self.num_stages > 1 and stages is not None and stages.size == self.num_stages
            if self._loss_in_norm:
                self.strategy.add_to_stage_sum(value.reshape(1))
            else:
                self.agg_train_loss = self._broadcast_loss(value)
                self._telemetry.observe_loss(self.agg_train_loss)
            self._optimizer_step()

    def _loss_from_norm(self, _global_steps: int) -> None:
        """A step-end hook: the step's loss, summed over the stages in the
        gradient norm's all-reduce (see [Note: the step's end])."""
        if not self._loss_in_norm:
            return
        self._loss_in_norm = False
        sums = self.strategy.take_stage_sums()
        if sums is None:
            raise RuntimeError(f"{type(self.strategy).__name__}.step did not reduce the pipeline's loss with the "
                               "gradient norm over the stages (GradientStrategy._stage_sq_norm)")
        self.agg_train_loss = sums[0]
        self._telemetry.observe_loss(self.agg_train_loss)

    def _aggregate_loss(self, losses: list[torch.Tensor], bcast: bool, reduce: str | None):
        """The last stage's losses averaged (over micro-batches, then over the
        data axis and the sequence axis: ZeRO's group, the ranks whose
        gradients are averaged), sent to every stage when `bcast` (collective
        over the pipe axis: a broadcast from the last stage). A loss_fn that
        returns the token mean of the whole sequence group
        (sequence_parallel_loss) holds the same value on each sequence rank;
        one returning its own tokens' mean is reported as the mean the
        gradients follow."""
        if reduce is None:
            return losses
        value = self._finish_replica_mean(self._start_replica_mean(losses))
        return self._broadcast_loss(value) if bcast else value

    def _start_replica_mean(self, losses: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """On the last stage (with losses), their mean and the asynchronous
        all-reduce of it over the stage's replicas (the sequence_data group;
        None with one replica); elsewhere a zero and None."""
        if not (self.is_last_stage() and losses):
            return torch.zeros((), dtype=torch.float32, device=self.device), None
        value = torch.stack(losses).mean()
        replicas = self.mesh.axis_group("sequence_data")
        return value, (comm.all_reduce(value, group=replicas.group, async_op=True) if replicas.size > 1 else None)

    def _finish_replica_mean(self, pending: tuple[torch.Tensor, Any]) -> torch.Tensor:
        """Wait for `_start_replica_mean`'s all-reduce: the mean over the replicas."""
        value, handle = pending
        if handle is None:
            return value
        handle.wait()
        return value / self.mesh.axis_group("sequence_data").size

    def _broadcast_loss(self, value: torch.Tensor) -> torch.Tensor:
        """`value` from the last stage on every stage (a broadcast over the pipe axis)."""
        if self.num_stages > 1:
            comm.broadcast(value, src=self.mesh.stage_to_global(self.num_stages - 1), group=self.mesh.group("pipe"))
        return value


def _to_device(value, device: torch.device, dtype: torch.dtype | None = None):
    """`value` (a tensor or nested tuple/list) on `device`, floating-point
    tensors cast to `dtype` when given (the stage's 16-bit compute dtype)."""
    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else None
        return value.to(device=device, dtype=cast)
    if isinstance(value, (tuple, list)):
        return tuple(_to_device(v, device, dtype) for v in value)
    return value


TiedGroups = list[tuple[list[torch.Tensor], Any]]


def _model_split(module: PipelineModule, mesh: ParallelMesh) -> ModelSplit:
    """What the checkpointer needs of the stages (see ModelSplit): the
    stage's replicas (its data x sequence ranks: Ulysses splits the tokens,
    not the weights, so the sequence ranks hold the stage's tensors alike
    and must split their writing with the data ranks), the pipe axis, and
    the tied copies the lowest stage holding them writes."""
    data = mesh.axis_group("sequence_data")
    duplicates = frozenset(n for n, p in module.named_parameters() if getattr(p, "ds_pipe_replicated", False))
    ranks = tuple(mesh.stage_to_global(s) for s in range(module.num_stages))
    return ModelSplit(RankGroup(data.group, data.rank, data.size), mesh.axis_group("pipe").group,
                      module.num_stages, ranks, duplicates)


def _other_coords(mesh: ParallelMesh) -> list[dict[str, int]]:
    """Every coordinate of the mesh's axes other than pipe (data, model, ...)."""
    axes = [a for a in mesh.topology.get_axis_names() if a != "pipe"]
    return [dict(zip(axes, c)) for c in itertools.product(*(range(mesh.topology.get_dim(a)) for a in axes))]


def tie_weights(module: PipelineModule, mesh: ParallelMesh) -> TiedGroups:
    """Make the copies of weights tied across stages equal and say how to
    reduce their gradients: for each key of `tied_weight_broadcast_plan`,
    create the process groups of the ranks holding its copies (one group per
    data (and model) coordinate; collective over the job, every rank in the same order),
    broadcast the key's tensors from its lowest stage, and return, for the
    keys this rank holds, (its tied tensors, its group). Call before the
    gradient strategy copies the parameters."""
    out = []
    for plan in module.tied_weight_broadcast_plan():
        group = mesh.make_group([tuple(mesh.stage_to_global(s, **coords) for s in plan.stages)
                                 for coords in _other_coords(mesh)])
        if group is not None:
            params = module.tied_parameters(plan.key)
            with torch.no_grad():
                for p in params:
                    comm.broadcast(p.data, src=mesh.stage_to_global(plan.src_stage), group=group.group)
            out.append((params, group.group))
    return out


def check_pipeline_config(cfg, module: PipelineModule) -> None:
    """The config's `pipeline` section against the module built before it
    was read (see PipelineConfig), applying `activation_checkpoint_interval`.

    Raises:
        ConfigError: stages, partition, seed_layers or virtual_stages differ
            from the module's, the schedule does not fit virtual_stages,
            or the zero-bubble schedule meets ZeRO stage 3.
    """
    pipe = cfg.pipeline
    problems = []
    if pipe.stages != "auto" and pipe.stages != module.num_stages:
        problems.append(f"pipeline.stages={pipe.stages} but PipelineModule(num_stages={module.num_stages})")
    if pipe.partition != "best" and pipe.partition != module.partition_method:
        problems.append(f"pipeline.partition={pipe.partition!r} but PipelineModule(partition_method="
                        f"{module.partition_method!r})")
    if pipe.seed_layers and not module.seed_layers:
        problems.append("pipeline.seed_layers=true but PipelineModule(seed_layers=False)")
    if pipe.virtual_stages != module.virtual_stages:
        problems.append(f"pipeline.virtual_stages={pipe.virtual_stages} but PipelineModule(virtual_stages="
                        f"{module.virtual_stages})")
    if (pipe.schedule == "interleaved") != (module.virtual_stages > 1):
        problems.append(f"pipeline.schedule={pipe.schedule!r} with virtual_stages={module.virtual_stages}: the "
                        "interleaved schedule needs virtual_stages >= 2 and the others 1")
    if cfg.zero_optimization.stage == 3 and pipe.schedule == "zb-h1":
        problems.append("pipeline.schedule='zb-h1' with zero_optimization.stage=3 is not supported: stage 3 "
                        "gathers a unit's parameters for one whole backward, which zero bubble splits into an "
                        "input pass and a later weight pass; use schedule 1f1b or interleaved, or ZeRO stage 1 or 2")
    if problems:
        raise ConfigError("the config does not fit the PipelineModule (built before the config is read): "
                          + "; ".join(problems) + ". Make them agree (or remove the keys from the config)")
    if "activation_checkpoint_interval" in pipe.model_fields_set:
        module.activation_checkpoint_interval = pipe.activation_checkpoint_interval  # DeepSpeed's override

"""Gradient strategies: how gradients get from autograd to the optimizer step.

`GradientStrategy` is the seam between the engine and the ZeRO stages. The
engine owns the training loop bookkeeping (micro-steps, accumulation
boundary, LR scheduler, logging) and never looks at the ZeRO stage; a
strategy owns everything that depends on it: where gradients live, how they
are reduced, how the norm is computed and clipped, how the optimizer steps
and how parameters are brought back in sync. `engine.build_strategy()` is
the one place that picks a strategy from the config.

`AllReduceStrategy` is stage 0 (plain data parallelism): every rank holds
all parameters, gradients and optimizer states; gradients are averaged with
bucketed all-reduces overlapped with backward. See [Note: bucket order].
"""
from __future__ import annotations

import abc
import dataclasses
import math

import torch

from dsrun.runtime.memory import allocator
from dsrun.runtime import comm
from dsrun.runtime.checkpoint.pieces import HeldPiece
from dsrun.runtime.comm.collectives import CompletedWork, overlapped_all_reduce
from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.parallel.expert.groups import expert_group_name_of, expert_groups, is_expert_param
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.strategy import sparse
from dsrun.runtime.strategy.hooks import HookSet
from dsrun.runtime.memory.accounting import tensor_breakdown
from dsrun.runtime.optim.precision import GradientDivision


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What an optimizer step did.

    Attributes:
        grad_norm: global L2 norm of the gradients (all ranks, all
            parameters, after averaging and unscaling, before clipping);
            None when the strategy did not compute it (e.g. on overflow).
        applied: False when the step was skipped (fp16 overflow, or a
            non-finite gradient in any precision); the engine then skips the
            LR scheduler step and counts a skipped step.
        nonfinite: the step was skipped because a gradient was inf/nan and
            no dynamic fp16 loss scale accounts for it (fp32, bf16, static
            fp16 scale); the engine stops the run after
            `max_consecutive_nonfinite_steps` of these in a row.
        first_nonfinite: qualified name of the first parameter (in the
            strategy's order) whose gradient was not finite, when known.
    """

    grad_norm: float | None
    applied: bool
    nonfinite: bool = False
    first_nonfinite: str | None = None


@dataclasses.dataclass(frozen=True)
class StageSpan:
    """The ranks holding the other parts of the model when one rank holds
    only a part (the pipeline stages with this rank's data-parallel
    coordinate): the gradient norm and the non-finite check of a step are
    summed over them too, so clipping uses the norm of the whole model and
    an overflow on any stage skips the step on every stage.

    Attributes:
        group: the torch process group of those ranks (this one included).
        size: its number of ranks (> 1).
        duplicates: ids of this rank's parameters whose gradient another
            rank of the group also holds in full (weights tied across
            stages, on every stage but the first that uses them): left out
            of the norm so that each counts once.
    """

    group: object
    size: int
    duplicates: frozenset[int] = frozenset()


class GradientStrategy(abc.ABC):
    """The interface every ZeRO stage implements (stage 0: AllReduceStrategy).

    Life cycle of one optimizer step with gradient accumulation steps = G:

    1. G times: the engine runs forward, divides the loss by G, then calls
       `backward(loss, sync=..., retain_graph=...)`. `sync` is True on the
       last micro-step (the accumulation boundary) unless the user is inside
       `engine.no_sync()`. When `backward` returns with sync=True, every
       rank must hold the averaged gradients (or its partition of them) the
       next `step` needs. With sync=False a strategy should send nothing;
       a stage that partitions gradients may still reduce (that is its
       trade), but must issue the same collectives on every rank.
    2. Once, at the boundary: `step(max_grad_norm)` computes the global
       gradient norm, clips when max_grad_norm > 0 (DeepSpeed's
       `gradient_clipping`, 0 = off), steps `self.optimizer` (unless it
       must skip, e.g. fp16 overflow) and leaves the module's parameters
       updated and identical on every rank.
    3. The engine then calls `zero_grad()`, steps the LR scheduler if the
       step was applied, and updates its counters.

    Attributes every strategy sets:
        optimizer: the torch.optim.Optimizer whose `param_groups` the LR
            scheduler drives and whose `lr` the engine reports. A stage that
            partitions may rewrite its param_groups to point at partitions.
        topology: the Topology of this rank.

    Rules: all collectives go through `dsrun.runtime.comm`; every rank must
    issue the same collectives in the same order whatever its data (no
    branch on a rank-local value before a collective); no method may hang a
    rank on bad input -- raise before communicating.
    """

    optimizer: torch.optim.Optimizer
    topology: Topology
    hooks: HookSet | None = None  # what `_register_hooks` registered (see [Note: strategy hooks] in hooks.py)
    stages: StageSpan | None = None  # set by `span_stages` when this rank holds one part of the model
    _stage_extra: torch.Tensor | None = None  # see `add_to_stage_sum`
    _stage_sums: torch.Tensor | None = None

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, *, sync: bool, retain_graph: bool) -> None:
        """Run autograd for one micro-step on `loss` (a scalar, already divided by G)."""

    def run_backward(self, autograd_call, *, sync: bool) -> None:
        """Run `autograd_call()` -- autograd work that accumulates gradients
        already multiplied by `loss_scale()` into the parameters (e.g. a
        pipeline's weight-gradient pass, [Note: zero bubble's split backward]
        in dsrun/runtime/engine/pipeline_engine.py) -- as `backward` runs its
        own, with the same reduction when `sync`.

        Raises:
            NotImplementedError: the strategy cannot take gradients this way
                (ZeRO stage 3, the 1-bit optimizers).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot run a split backward (zero-bubble pipeline "
                                  "schedule); use ZeRO stage 0, 1 or 2")

    @abc.abstractmethod
    def step(self, max_grad_norm: float) -> StepOutcome:
        """Clip and apply one optimizer step at the accumulation boundary."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop the accumulated gradients (set to None where possible)."""

    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward (fp16 loss
        scaling; 1.0 where the strategy does not scale)."""
        return 1.0

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds per category ("params", "grads", "master",
        "optimizer_states") and dtype name (default: the optimizer's
        parameters, their .grad and its state tensors; ZeRO overrides it)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        states = [t for st in self.optimizer.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        grads = [t for p in params for t in sparse.held(p.grad)]
        return tensor_breakdown({"params": params, "grads": grads,
                                 "master": [], "optimizer_states": states})

    # ---- what a checkpoint asks (dsrun/runtime/checkpoint/parts.py) -------------
    # Defaults for a strategy that keeps every parameter whole on every rank:
    # the checkpointer then saves them all as plain tensors.
    def checkpoint_pieces(self) -> list[HeldPiece]:
        """This rank's pieces of the parameters the strategy manages (its
        partitions, with their optimizer state); default: none."""
        return []

    def managed_params(self) -> list[torch.nn.Parameter]:
        """The parameters `checkpoint_pieces` covers (the checkpointer saves
        every other one whole); default: none."""
        return []

    def manages(self, param: torch.Tensor) -> bool:
        """Whether `param` is one of `managed_params` (its full value then
        comes from `full_fp32_param`, a collective); default: False."""
        return False

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype managed parameters compute in (what a 16-bit export
        writes them as); None when no parameter is managed."""
        return None

    def after_checkpoint_load(self) -> None:
        """Called on every rank after a load wrote into the pieces (may be a
        collective); default: nothing to rebuild."""

    def precision_name(self) -> str:
        """The precision recorded in a checkpoint's index ("fp32", "bf16", "fp16")."""
        return "fp32"

    def scaler_state(self) -> dict | None:
        """The loss scaler's state to checkpoint (None: no scaler)."""
        return None

    def load_scaler_state(self, state: dict) -> None:
        """Restore a scaler state a checkpoint holds, when the strategy has a
        scaler of the same kind; default: ignored."""

    def offload_timeline(self) -> dict:
        """The last optimizer step's offload timeline (see
        dsrun/runtime/offload/transfer.py); empty when nothing is offloaded
        from an accelerator (the default)."""
        return {}

    def close(self) -> None:
        """Remove every hook the strategy registered on the model (its
        `hooks`, see [Note: strategy hooks] in hooks.py) and stop what it
        started (threads, swap files); the strategy cannot train afterwards.
        Calling it again does nothing. Default: remove `hooks`."""
        if self.hooks is not None:
            self.hooks.remove()

    # ---- a model split across ranks (pipeline stages) ------------------------------
    def span_stages(self, stages: StageSpan) -> None:
        """Reduce the gradient norm and the non-finite check over `stages`
        too (see StageSpan); called once, before the first backward."""
        self.stages = stages

    def add_to_stage_sum(self, values: torch.Tensor) -> None:
        """Sum `values` (1-D, fp32) over the stage span (StageSpan.group) in
        the same all-reduce as the next `step`'s gradient norm, so that a
        pipeline's step-end values (its loss) need no collective of their
        own; `take_stage_sums` returns the sums after that step. Every rank of
        the span must add values of the same length before the same step.
        Without a stage span, nothing reduces them (`take_stage_sums` then
        returns None)."""
        self._stage_extra = values.reshape(-1)

    def take_stage_sums(self) -> torch.Tensor | None:
        """The sums of what `add_to_stage_sum` gave, reduced by the last
        `step` (1-D fp32, the same on every rank of the span), once; None when
        no step has reduced them since (no stage span)."""
        sums, self._stage_sums = self._stage_sums, None
        return sums

    def _stage_sq_norm(self, sq: torch.Tensor, duplicate_sq: torch.Tensor | float) -> torch.Tensor:
        """This rank's squared norm `sq` (shape (1,), fp32, already summed over
        its data-parallel group) minus that of its duplicate gradients, summed
        over the stages (collective over `stages.group`), together with any
        values of `add_to_stage_sum` (one all-reduce); `sq` itself when the
        model is not split."""
        if self.stages is None:
            return sq
        sq = (sq - duplicate_sq).reshape(1)
        extra, self._stage_extra = self._stage_extra, None
        if extra is not None:
            sq = torch.cat([sq, extra.to(device=sq.device, dtype=sq.dtype)])
        comm.all_reduce(sq, group=self.stages.group)
        if extra is not None:
            self._stage_sums, sq = sq[1:], sq[:1]
        return sq

    def sum_gradients_across(self, params: list[torch.nn.Parameter], group) -> None:
        """Add the averaged gradients of `params` over the ranks of `group`
        that hold the same parameters (weights tied across pipeline stages;
        every rank of `group` passes its copies in the same order). Called
        after the accumulation boundary's backward, before `step`.
        Default: the parameters' `.grad`, which hold the whole averaged
        gradient here; a strategy that partitions gradients overrides it."""
        for p in params:
            if p.grad is not None:
                comm.all_reduce(p.grad, group=group)

    def state_dict(self) -> dict:
        """Strategy state to checkpoint (default: the optimizer's state_dict)."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
        self.optimizer.load_state_dict(state["optimizer"])


@dataclasses.dataclass
class _Bucket:
    """Parameters whose gradients travel in one all-reduce.

    `flat` (1-D, numel elements, the parameters' dtype) is allocated once
    and holds the parameters' gradients (their `.grad` are views of it); `ready` holds ids of parameters whose gradient is final for
    this backward.
    """

    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    group: object = None  # the process group it is summed over (None: every rank)
    alone: bool = False  # the group is this rank alone (a pipeline stage without replicas): nothing to sum
    ready: set[int] = dataclasses.field(default_factory=set)
    handle: comm.Handle | None = None

    def is_ready(self) -> bool:
        return len(self.ready) == len(self.params)


def plan_buckets(params: list[torch.nn.Parameter], bucket_size: int,
                 key=lambda p: None) -> list[list[torch.nn.Parameter]]:
    """Split `params` (in order) into runs of at most `bucket_size` elements
    of one dtype/device and one `key(p)` (e.g. the group they are reduced over).

    A parameter larger than `bucket_size` gets a bucket of its own.

    Raises:
        ValueError: bucket_size < 1.
    """
    if bucket_size < 1:
        raise ValueError(f"reduce_bucket_size must be >= 1 element, got {bucket_size}")
    buckets: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        same_kind = not current or (p.dtype == current[0].dtype and p.device == current[0].device
                                    and key(p) == key(current[0]))
        if current and (size + p.numel() > bucket_size or not same_kind):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(current)
    return buckets


class AllReduceStrategy(GradientStrategy):
    """ZeRO stage 0: replicated parameters, gradients averaged by bucketed all-reduce.

    [Note: bucket order]
    Gradients are grouped into flat buckets of at most `bucket_size`
    elements, in reverse registration order (roughly the order backward
    produces them). Each parameter's `.grad` is a view into its bucket,
    created once, so autograd accumulates straight into the buffer that is
    all-reduced (16Ψ bytes with Adam, not 20Ψ: no separate bucket copy) and
    `zero_grad` zeroes the buckets. A post-accumulate-grad hook on every
    parameter marks it ready during a sync backward; when the *next* bucket
    in order is complete it is averaged in place by `overlapped_all_reduce`
    (over shared memory: on the communication thread, see [Note: overlap on
    a communication thread] in comm/collectives.py), so communication
    overlaps the rest of backward. Buckets
    are launched strictly in bucket order -- never out of order even when a
    later bucket fills first -- so every rank issues the same sequence of
    collectives even when ranks see different data and hooks fire in a
    different order. Parameters that got no gradient (unused in this
    forward, or unused on this rank) hold zeros; at the end of backward the
    remaining buckets are flushed in order, then we wait for each handle and
    divide its bucket. A bucket is divided by the world size after its sum,
    or partly before it (prescale_gradients, gradient_predivide_factor: see
    [Note: dividing around the reduction] in optim/precision.py).

    [Note: expert gradients]
    An expert parameter of an MoE layer (`allreduce = False`, `group_name`;
    runtime/parallel/expert/groups.py) sits in buckets of its own, summed
    over its expert-data-parallel group only (the ranks holding the same
    experts), then divided like the others by the data-parallel size: each
    copy of an expert has seen the tokens of its whole expert-parallel
    group, so the sum over its expert-data group covers every data rank
    once and the result is the data-parallel average. This is DeepSpeed's
    divisor (checked against 0.19.8: engine._reduce_expert_gradients
    all-reduces expert buckets over the expert-data-parallel group and
    divides by the data-parallel world size "to maintain the gradients
    value unaffected by ep_size"; ZeRO 1-2's average_tensor divides by it
    too), so the same script trains alike on both. Expert gradients
    differ across an expert-parallel group, so the step's norm adds their
    squares over it (each expert counted once; DeepSpeed averages the
    expert norm over the expert-data group instead, #8475). ZeRO stages
    and 16-bit precision do the same with partitions: [Note: expert
    partitions] in dsrun/runtime/zero/experts.py.

    Args:
        module: the model (parameters with requires_grad are reduced).
        optimizer: a torch optimizer over (some of) module's parameters.
        topology: this rank's Topology.
        bucket_size: maximum elements per all-reduce (DeepSpeed's
            `reduce_bucket_size`).
        group: process group to average over (None = all ranks).
        division: where the averaging divides (default: after the sum).
        sparse_gradients: reduce the weights of nn.Embedding and
            nn.EmbeddingBag by their rows after the buckets, outside them
            (see [Note: sparse embedding gradients] in sparse.py).
        mesh: the job's ParallelMesh, whose expert groups the expert
            parameters are reduced over.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 topology: Topology, bucket_size: int, group=None,
                 division: GradientDivision = GradientDivision(), sparse_gradients: bool = False, *,
                 mesh: ParallelMesh) -> None:
        self.optimizer = optimizer
        self.topology = topology
        self._group = group
        self._division = division
        self._before, self._after = division.divisors(comm.get_world_size(group))
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._by_rows = sparse.embedding_weights(module) if sparse_gradients else []
        self._experts = {name: expert_groups(name, mesh) for name in
                         sorted({expert_group_name_of(p) for p in self._params if is_expert_param(p)})}
        by_rows = {id(p) for p in self._by_rows if not is_expert_param(p)}
        self._by_rows = [p for p in self._by_rows if id(p) in by_rows]
        allocator.adopt_parameters(module.parameters())  # kept in place: onto dsrun's huge pages
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._buckets = [
            _Bucket(ps, torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device),
                    self._reduction_group(ps[0]), alone=comm.get_world_size(self._reduction_group(ps[0])) == 1)
            for ps in plan_buckets([p for p in reversed(self._params) if id(p) not in by_rows], bucket_size,
                                   key=lambda p: expert_group_name_of(p) if is_expert_param(p) else None)
        ]
        self._attach_grads()
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
        self._next_bucket = 0
        self._syncing = False
        self._register_hooks()

    def _reduction_group(self, param: torch.nn.Parameter):
        """The group `param`'s gradient is summed over (see [Note: expert gradients])."""
        if is_expert_param(param):
            return self._experts[expert_group_name_of(param)].expert_data_group
        return self._group

    def _register_hooks(self) -> None:
        """The gradient hook of every trainable parameter (see [Note: bucket order])."""
        self.hooks = HookSet()
        for bucket in self._buckets:
            for p in bucket.params:
                self.hooks.on_grad_accumulated(p, "dsrun::reduce_grad", self._on_grad_ready)

    def _attach_grads(self) -> None:
        """Make every parameter's .grad its view of the bucket (again, if a
        user replaced or dropped it)."""
        for bucket in self._buckets:
            offset = 0
            for p in bucket.params:
                view = bucket.flat[offset:offset + p.numel()]
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view.view_as(p)  # autograd accumulates into it in place
                offset += p.numel()

    def backward(self, loss: torch.Tensor, *, sync: bool, retain_graph: bool) -> None:
        self.run_backward(lambda: loss.backward(retain_graph=retain_graph), sync=sync)

    def run_backward(self, autograd_call, *, sync: bool) -> None:
        self._syncing = sync
        try:
            autograd_call()
            if sync:
                self._flush()
        finally:
            self._syncing = False

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._syncing:
            return
        self._buckets[self._bucket_of[id(param)]].ready.add(id(param))
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # See [Note: bucket order]: only ever launch the next bucket in order.
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].is_ready():
            bucket = self._buckets[self._next_bucket]
            if self._before != 1.0:
                bucket.flat.div_(self._before)
            # a one-rank group would still cost a hand-off to gloo's thread and back
            bucket.handle = CompletedWork() if bucket.alone else overlapped_all_reduce(bucket.flat, group=bucket.group)
            self._next_bucket += 1

    def _flush(self) -> None:
        """Mark parameters without a gradient ready (theirs is zero), launch
        the rest in order, wait, divide."""
        for bucket in self._buckets:
            bucket.ready.update(id(p) for p in bucket.params)
        self._launch_ready_buckets()
        for bucket in self._buckets:
            bucket.handle.wait()  # blocks until this bucket's sum is in place
            bucket.handle = None
            if self._after != 1.0:
                bucket.flat.div_(self._after)
            bucket.ready.clear()
        self._next_bucket = 0
        for p in self._by_rows:
            sparse.reduce_rows(p, self._group, self._division)

    def step(self, max_grad_norm: float) -> StepOutcome:
        params = [p for p in self._params if p.grad is not None]
        # Gradients are identical on every rank after the all-reduce, so the
        # local norm is the data-parallel norm: no communication needed
        # (unless the model is split over stages or holds experts).
        if self._experts:
            norm = self._with_experts_norm(params)
        else:
            norm = torch.nn.utils.get_total_norm([sparse.norm_view(p.grad) for p in params], norm_type=2.0)
        if self.stages is not None:  # experts' duplicates are left out before their expert-parallel sum
            dup = [sparse.norm_view(p.grad) for p in params
                   if id(p) in self.stages.duplicates and not is_expert_param(p)]
            dup_sq = torch.nn.utils.get_total_norm(dup, norm_type=2.0).square() if dup else 0.0
            norm = self._stage_sq_norm(norm.float().square().reshape(1), dup_sq).sqrt()[0]
        if not math.isfinite(float(norm)):
            # inf/nan survive the sum, so every rank sees it and skips alike.
            first = next((p for p in params if not bool(torch.isfinite(sparse.norm_view(p.grad)).all())), None)
            return StepOutcome(grad_norm=None, applied=False, nonfinite=True,
                               first_nonfinite=None if first is None else self._names.get(id(first)))
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
        self.optimizer.step()
        return StepOutcome(grad_norm=float(norm), applied=True)

    def _with_experts_norm(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The norm over this rank's plain gradients and every expert's
        gradient of its expert-parallel groups (see [Note: expert gradients];
        an all-reduce per expert group name). An expert this rank holds as a
        duplicate (replicated over the model axis: on model rank > 0, see
        model_parallel.py [Note: counting each gradient once]) adds nothing."""
        duplicates = self.stages.duplicates if self.stages is not None else frozenset()
        def sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
            if not grads:
                return torch.zeros(1, dtype=torch.float32, device=params[0].device if params else "cpu")
            return torch.nn.utils.get_total_norm(grads, norm_type=2.0).float().square().reshape(1)

        total = sq_norm([sparse.norm_view(p.grad) for p in params if not is_expert_param(p)])
        for name, groups in self._experts.items():
            sq = sq_norm([p.grad for p in params if is_expert_param(p) and expert_group_name_of(p) == name
                          and id(p) not in duplicates])
            if groups.expert_parallel.size > 1:
                comm.all_reduce(sq, group=groups.ep_group)
            total = total + sq
        return total.sqrt()[0]

    def zero_grad(self) -> None:
        for bucket in self._buckets:
            bucket.flat.zero_()
        self._attach_grads()
        for p in self._by_rows:
            p.grad = None

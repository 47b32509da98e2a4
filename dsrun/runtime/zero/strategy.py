"""What every ZeRO strategy shares: the optimizer step on partitions.

A stage subclass builds its `FlatParamSet`s and decides where gradients are
reduced (`backward`) and how parameters come back after the step
(`_after_step`); this base class does the rest, identically for all stages:
loss scaling, the global norm and non-finite check, the step itself,
memory accounting and full-tensor reads.

[Note: one small collective per step]
The global squared gradient norm travels in one all_reduce of a 1-element
fp32 tensor over the shard group (replicas hold the same shards), on every
rank, every step, so no rank branches on a local value before a
collective. A non-finite norm (inf/nan anywhere, any rank) skips the
optimizer step on all ranks; with fp16 the loss scaler shrinks, and the
engine skips the LR scheduler (StepOutcome.applied).

[Note: fused step]
When the optimizer is one of dsrun's Adam classes (`dsrun.ops.adam`:
CPUAdam, DeepSpeedCPUAdam, FusedAdam; what ds_config's "Adam"/"AdamW" build
unless `torch_adam` is set), the step runs dsrun's Adam kernel
directly on each span's flat, contiguous master shards: one pass reads the
gradient (any accumulation dtype), multiplies it by 1/loss_scale times the
clipping coefficient, updates master and moments, and writes the 16-bit
compute copy. No unscaled or clipped gradient copy, no separate cast, and
the work is cut into chunks of at most `sub_group_size` elements. Any other
optimizer -- a torch.optim.AdamW object included, whose arithmetic a user
may rely on bit for bit -- gets the torch path: the gradient shards are
scaled in place and handed to `optimizer.step()` as the masters' `.grad`.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from dsrun.ops import adam as native_adam
from dsrun.runtime import comm
from dsrun.runtime.checkpoint.pieces import HeldPiece, even_part
from dsrun.runtime.strategy.data_parallel import GradientStrategy, StepOutcome
from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.memory.accounting import tensor_breakdown
from dsrun.runtime.offload.optimizer_tier import OptimizerTier
from dsrun.runtime.offload.param_tier import ParamTier
from dsrun.runtime.optim.precision import PrecisionPolicy
from dsrun.runtime.parallel.expert.names import global_expert_name
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.zero.experts import add_expert_sq_norms
from dsrun.runtime.zero.flat_params import FlatParamSet, Span
from dsrun.runtime.zero.groups import ZeroGroups
from dsrun.runtime.zero.params import ensure_record, home_device, record_of
from dsrun.runtime.zero.watchdog import Watchdog

log = logging.getLogger("dsrun.zero")


def owner_of(param: torch.Tensor) -> "ZeroStrategy | None":
    """The ZeRO strategy managing `param`, or None."""
    rec = record_of(param)
    return rec.strategy if rec is not None else None


class ZeroStrategy(GradientStrategy):
    """Base of the ZeRO strategies; see the module docstring.

    Subclasses set `self.sets` (list[FlatParamSet]) and call
    `_adopt(fset, unit_of_slot)` for each, then `_bind_optimizer()`; they
    implement `backward` and `_after_step`.

    Args:
        optimizer: a freshly built torch optimizer over the model's parameters.
        topology: this rank's Topology.
        precision: dtypes and loss scaler.
        groups: the (shard, replicate) pair (see groups.py).
        sub_group_size: most elements the fused step processes at once.
        watchdog_timeout: seconds before a blocked collective is reported.
        optimizer_tier: where masters and optimizer states live (None: with
            the parameters); see dsrun/runtime/offload/optimizer_tier.py.
        mesh: the job's ParallelMesh (expert parameters' groups and names).

    Attributes the optimizer tiers read (offload/optimizer_tier.py):
        sets: the FlatParamSets, in step order.
        master_views: (set, span, master view) per span, in step order; the
            view (span.hi - span.lo elements, fp32) is the tensor the
            optimizer's param group holds and its state is keyed by.
        fused: the optimizer is one of dsrun's Adam classes, stepped by the
            native kernel (see [Note: fused step]).

    Raises:
        ValueError: the optimizer already holds state.
    """

    stage: int

    def __init__(self, optimizer: torch.optim.Optimizer, topology: Topology,
                 precision: PrecisionPolicy, groups: ZeroGroups, sub_group_size: int = 1_000_000_000,
                 watchdog_timeout: float | None = None, optimizer_tier: OptimizerTier | None = None, *,
                 mesh: ParallelMesh):
        if any(optimizer.state.values()):
            raise ValueError("the optimizer already holds state; give ZeRO a freshly built optimizer "
                             "(load a checkpoint through the engine instead)")
        self.optimizer = optimizer
        self.topology = topology
        self.precision = precision
        self.mesh = mesh
        self.groups = groups
        self.rank = groups.shard.rank
        self.sub_group_size = sub_group_size
        self.watchdog = Watchdog(topology.rank, watchdog_timeout)
        self.sets: list[FlatParamSet] = []
        self.last_overflow_param: str | None = None
        self.master_views: list[tuple[FlatParamSet, Span, torch.Tensor]] = []
        self.fused = isinstance(optimizer, native_adam.NativeAdam)
        self.optimizer_tier = optimizer_tier or OptimizerTier(sub_group_size=self.sub_group_size)
        self.param_tier = ParamTier()  # stage 3 may offload its partitions (offload/param_tier.py)

    # ---- construction helpers ------------------------------------------
    def _prepare_tier(self, trainable) -> None:
        """Tell the optimizer tier the trainable parameters' full sizes
        (before any FlatParamSet is built; NVMe reserves its files here)."""
        numels = [rec.numel if (rec := record_of(p)) is not None else p.numel() for p, _, _ in trainable]
        self.optimizer_tier.prepare(self, numels, self.groups.shard.size)

    def _master_device(self, param: torch.Tensor) -> torch.device:
        """Where the optimizer tier wants the master of a set holding `param`."""
        return self.optimizer_tier.master_device(home_device(param))

    def _adopt(self, fset: FlatParamSet, unit=None) -> None:
        """Give every parameter of `fset` its record pointing here, and the
        set to the optimizer tier."""
        for slot in fset.layout.slots:
            ensure_record(fset.params[slot.index]).adopt(self, fset, slot.index, slot.name, unit)
        self.optimizer_tier.adopt(self, fset)

    def _bind_optimizer(self) -> None:
        """Point the optimizer's param groups at the master shards (one tensor per span)."""
        per_group: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        for fset in self.sets:
            for span in fset.spans:
                view = fset.master_view(span)
                self.master_views.append((fset, span, view))
                per_group[span.group].append(view)
        for group, views in zip(self.optimizer.param_groups, per_group):
            group["params"] = views
        self.optimizer_tier.bind(self)

    @staticmethod
    def trainable_groups(optimizer: torch.optim.Optimizer, module: torch.nn.Module):
        """(param, qualified name, group index) of every trainable optimizer
        parameter, in module registration order. Raises ValueError for a
        parameter that is not the module's or sits in two groups."""
        names = {id(p): n for n, p in module.named_parameters()}
        group_of: dict[int, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError("the optimizer holds a parameter that is not part of the model "
                                     f"(shape {tuple(p.shape)}); build it from model.parameters()")
                if id(p) in group_of and group_of[id(p)] != gi:
                    raise ValueError(f"parameter {names[id(p)]} is in two optimizer param groups")
                group_of[id(p)] = gi
        return [(p, n, group_of[id(p)]) for n, p in module.named_parameters()
                if id(p) in group_of and p.requires_grad]

    # ---- the step --------------------------------------------------------
    def _scale(self, loss: torch.Tensor) -> torch.Tensor:
        scale = self.precision.scaler.scale
        return loss * scale if scale != 1.0 else loss

    def _global_sq_norm(self) -> float:
        """Sum of squares of every averaged gradient shard over the shard group
        (one collective, carrying a pipeline stage's duplicates too; see
        [Note: one small collective per step]; two more
        per expert group name, see [Note: expert partitions] in experts.py)."""
        sq = self._local_sq([f for f in self.sets if f.experts is None])
        # a pipeline stage's duplicates ride in the same all-reduce (no collective of their own)
        dup = self._duplicate_sq() if self.stages is not None else None
        with self.watchdog.waiting("all-reduce of the gradient norm (optimizer step)"):
            if self.groups.shard.size > 1:
                both = sq if dup is None else torch.cat([sq, dup])
                comm.all_reduce(both, group=self.groups.shard.group)
                sq, dup = (both, None) if dup is None else (both[:1], both[1:])
            experts = {f.experts.name: f.experts for f in self.sets if f.experts is not None}
            if experts:  # each expert shard once (see [Note: expert partitions] in experts.py)
                local = {name: self._local_sq([f for f in self.sets if f.experts is not None
                                               and f.experts.name == name and not self._duplicate_set(f)])
                         for name in experts}
                sq = sq + add_expert_sq_norms(local, experts)
        if self.stages is not None:
            with self.watchdog.waiting("all-reduce of the gradient norm over the pipeline stages"):
                sq = self._stage_sq_norm(sq, dup)
        return float(sq.item())  # the one host sync of the step

    def _local_sq(self, sets: list[FlatParamSet]) -> torch.Tensor:
        """This rank's sum of squares of the averaged gradient shards of
        `sets`, (1,) fp32 on the device; no communication."""
        grads = [g for fset in sets for g in fset.grad_shards() if g.numel()]
        host = self.optimizer_tier.host_grads
        if host is not None:  # gradients in host memory (see [Note: offload copies] in offload/transfer.py)
            return host.sq_norm(grads, self.topology.device)
        if grads:
            norms = torch._foreach_norm(grads)  # one fused pass, no gradient-sized temporary
            return torch.stack([n.float() for n in norms]).square().sum().reshape(1)
        return torch.zeros(1, dtype=torch.float32, device=self.topology.device)

    def _duplicate_set(self, fset: FlatParamSet) -> bool:
        """Whether every parameter of `fset` is a stage duplicate (experts
        replicated over the model axis, on model rank > 0): an expert set's
        duplicates are left out before its expert-parallel sum, not after.

        Raises:
            NotImplementedError: an expert set holding duplicates and other
                parameters (experts split by tensor parallelism).
        """
        if self.stages is None:
            return False
        dup = [id(p) in self.stages.duplicates for p in fset.params]
        if any(dup) and not all(dup):
            raise NotImplementedError("expert parameters split by tensor parallelism (expert tensor parallelism) "
                                      "are not supported: keep the experts' layers plain (replicated over the "
                                      "model axis)")
        return all(dup)

    def _duplicate_sq(self) -> torch.Tensor:
        """This rank's squared norm of its pieces of the stage duplicates'
        gradients (see StageSpan), (1,) fp32 on the device, no communication
        (`_global_sq_norm` sums it over the shard group in the norm's
        all-reduce); experts are left out (see `_duplicate_set`)."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.topology.device)
        for p in self.managed_params():
            if id(p) in self.stages.duplicates and record_of(p).fset.experts is None:
                rec = record_of(p)
                piece = rec.fset.local_piece_tensor(rec.fset.partition_of(rec.fset.grad_view), rec.slot)
                sq += piece.square().sum()
        return sq

    def sum_gradients_across(self, params: list[torch.nn.Parameter], group) -> None:
        """Add the averaged gradients of `params` over `group` (weights tied
        across pipeline stages): each parameter's gradient is assembled over
        the shard group, summed over `group`, and this rank's pieces written
        back (collective over both; the shard layouts of the stages may differ)."""
        if self.optimizer_tier.host_grads is not None and params:
            self.optimizer_tier.host_grads.written_elsewhere()
        for p in params:
            rec = record_of(p)
            fset = rec.fset
            full = self._full_from_partition(p, lambda f: f.partition_of(f.grad_view)).reshape(-1)
            comm.all_reduce(full, group=group)
            for piece in fset.layout.local_pieces(fset.rank):
                if piece.slot.index != rec.slot:
                    continue
                so, n = piece.shard_offset, piece.hi - piece.lo
                for span in fset.spans:
                    lo, hi = max(so, span.lo), min(so + n, span.hi)
                    if lo < hi:
                        src = full[piece.lo + lo - so:piece.lo + hi - so]
                        fset.grad_view(span)[lo - span.lo:hi - span.lo].copy_(src)

    def step(self, max_grad_norm: float) -> StepOutcome:
        scale = self.precision.scaler.scale
        sq = self._global_sq_norm()
        finite = math.isfinite(sq)
        self.precision.scaler.update(not finite)  # raises LossScaleUnderflowError at the floor
        if not finite:
            self._report_nonfinite(scale)
            return StepOutcome(grad_norm=None, applied=False, nonfinite=not self.precision.scaler.dynamic,
                               first_nonfinite=self.last_overflow_param)
        norm = math.sqrt(sq) / scale
        factor = 1.0 / scale
        if max_grad_norm > 0 and norm > max_grad_norm:
            factor *= max_grad_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s epsilon
        self._settle()
        self.optimizer_tier.step(self, factor)  # see [Note: optimizer tiers] in offload/optimizer_tier.py
        self._after_step()
        return StepOutcome(grad_norm=norm, applied=True)

    def _report_nonfinite(self, scale: float) -> None:
        """Name the first parameter (in layout order) with a non-finite
        gradient on any rank: one all_reduce(MIN) of its index, no pickling."""
        names = [s.name for fset in self.sets for s in fset.layout.slots]
        base, first = 0, len(names)
        for fset in self.sets:
            grad = fset.partition_of(fset.grad_view)
            for piece in fset.layout.local_pieces(fset.rank):
                if fset.key_of_bucket[piece.slot.bucket] is None:
                    continue  # frozen: no gradient
                g = grad[piece.shard_offset:piece.shard_offset + piece.hi - piece.lo]
                if not bool(torch.isfinite(g).all()):
                    first = min(first, base + piece.slot.index)
            base += len(fset.layout.slots)
        index = torch.tensor([first], dtype=torch.float32, device=self.topology.device)
        if self.groups.shard.size > 1:
            comm.all_reduce(index, op=torch.distributed.ReduceOp.MIN, group=self.groups.shard.group)
        found = int(index.item())
        self.last_overflow_param = names[found] if found < len(names) else None
        if self.topology.rank == 0 and self.precision.scaler.dynamic:  # else the engine warns
            what = ("fp16 gradient overflow" if self.precision.compute_dtype == torch.float16
                    else "non-finite gradient")
            log.warning("%s (first in parameter %s); skipping step, loss scale %g -> %g", what,
                        self.last_overflow_param, scale, self.precision.scaler.scale)

    def span_stepped(self, fset: FlatParamSet, span: Span) -> None:
        """The optimizer tier finished `span`'s new values (its compute
        shards are final for this step); a stage may start sending them."""

    def _after_step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Remove the hooks (see [Note: strategy hooks] in dsrun/runtime/strategy/hooks.py),
        then close the optimizer and parameter tiers (threads, aio handles,
        swap files) and stop the watchdog. Parameters keep what they hold
        now: full values at stages 0-2, their partitions at stage 3
        (gather what you need before, e.g. with GatheredParameters or
        save_16bit_model). Calling it again does nothing."""
        super().close()
        self.optimizer_tier.close()
        self.param_tier.close()
        self.watchdog.close()

    def zero_grad(self) -> None:
        host = self.optimizer_tier.host_grads
        for fset in self.sets:
            if host is None or not fset.grads_offloaded:
                fset.zero_grad()
        if host is not None:
            host.reset()  # host gradients are overwritten by the next backward, not zeroed

    # ---- state -------------------------------------------------------------
    def state_dict(self) -> dict:
        self._materialize()
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.precision.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._materialize()
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.scaler.load_state_dict(state["scaler"])

    # ---- accounting and full-tensor reads ---------------------------------
    def _held(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank holds per category (subclasses add their own)."""
        states = [t for st in self.optimizer.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        held = {
            "params": [t for f in self.sets for t in (f.full, f.partition) if t is not None],
            "grads": [t for f in self.sets for t in (f.grad_full, f.grad_partition) if t is not None],
            "master": [f.master for f in self.sets if f.master is not None],
            "optimizer_states": states,
            "comm_buffers": [r.staging for r in self.reducer.regions
                             if r.staging is not None and not r.in_place],
        }
        for category, tensors in self.optimizer_tier.held(self).items():
            held.setdefault(category, []).extend(tensors)
        return held

    def loss_scale(self) -> float:
        return self.precision.scaler.scale

    def offload_timeline(self) -> dict:
        tier = self.optimizer_tier
        return tier.timeline.last if tier.uploads is not None else {}

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds per category (params, gathered_params,
        grads, master, optimizer_states, comm_buffers) and dtype, counting
        flat buffers whole (padding included). Step counters (0-dim tensors)
        are not counted. With offload, `offload_buffers` are the host
        buffers the offload tiers stream through and `nvme_swap` the bytes of
        this rank's swap files (on disk, not in memory)."""
        out = tensor_breakdown(self._held())
        nvme = self._nvme_bytes()
        if nvme:
            out["nvme_swap"] = {"fp32": nvme}
        return out

    def _nvme_bytes(self) -> int:
        return self.optimizer_tier.nvme_bytes() + self.param_tier.nvme_bytes()

    def _materialize(self) -> None:
        """Offloaded masters, states and partitions as ordinary tensors, for
        code outside the step (see [Note: streamed step])."""
        self.optimizer_tier.materialize(self)
        self.param_tier.materialize(self)

    def _settle(self) -> None:
        """Back to their tiers (written back) after `_materialize`."""
        self.optimizer_tier.settle(self)
        self.param_tier.settle(self)

    def _full_from_partition(self, param: torch.nn.Parameter,
                             source: Callable[[FlatParamSet], torch.Tensor]) -> torch.Tensor | None:
        """Sum every shard-group rank's pieces of `param` read from the
        partition-shaped tensor source(fset) (collective: all ranks must
        call). None if param is not ours."""
        rec = record_of(param)
        if rec is None or rec.strategy is not self:
            return None
        piece = rec.fset.local_piece_tensor(source(rec.fset), rec.slot)
        shard = rec.fset.reduce_groups(self.groups).shard
        if shard.size > 1:
            comm.all_reduce(piece, group=shard.group)
        return piece

    def sync_master_from_params(self, params) -> None:
        """After `params` (full values, e.g. inside GatheredParameters) were
        modified identically on every rank, copy this rank's pieces of them
        into the master weights and, for stage 3, the compute partition."""
        self._materialize()  # written back at the next step
        for p in params:
            rec = record_of(p)
            if rec is None or rec.strategy is not self:
                continue
            fset = rec.fset
            flat = p.detach().reshape(-1)
            trainable = fset.key_of_bucket[fset.layout.slots[rec.slot].bucket] is not None
            for piece in fset.layout.local_pieces(fset.rank):
                if piece.slot.index != rec.slot:
                    continue
                lo, n = piece.shard_offset, piece.hi - piece.lo
                if fset.partition is not None:
                    fset.partition_piece(lo, n).copy_(flat[piece.lo:piece.hi])
                if fset.master is not None and trainable:
                    fset.master[lo:lo + n].copy_(flat[piece.lo:piece.hi])

    def full_fp32_param(self, param):
        """Full fp32 master value of `param` (its compute value if frozen; collective)."""
        self._materialize()
        def source(fset: FlatParamSet) -> torch.Tensor:
            out = fset.partition_of(fset.master_view)
            if fset.partition is not None:  # frozen parameters (stage 3) have no master
                out[fset.trainable_shard_numel:].copy_(fset.frozen_values())
            return out
        return self._full_from_partition(param, source)

    def full_grad(self, param):
        """Full averaged gradient of `param` as fp32, unscaled (collective)."""
        scale = self.precision.scaler.scale
        out = self._full_from_partition(param, lambda f: f.partition_of(f.grad_view))
        return out if out is None or scale == 1.0 else out / scale

    def full_optimizer_state(self, param, key: str):
        """Full optimizer state `key` (e.g. "exp_avg") of `param` (collective)."""
        self._materialize()
        views = {(id(f), s): v for f, s, v in self.master_views}

        def read(fset, span):
            st = self.optimizer.state.get(views[(id(fset), span)], {})
            return st[key] if key in st else torch.zeros(span.hi - span.lo, device=self.topology.device)
        return self._full_from_partition(param, lambda f: f.partition_of(lambda span: read(f, span)))

    # ---- checkpoints (see dsrun/runtime/checkpoint) --------------------------
    def checkpoint_pieces(self) -> list[HeldPiece]:
        """This rank's pieces of every parameter it manages, as
        `dsrun.runtime.checkpoint.pieces.HeldPiece`s: trainable ones point at
        the fp32 master and their span's optimizer state, frozen ones (stage
        3) at the compute partition. Replicas split what they write evenly.
        Offloaded masters and states are read into memory first (see
        [Note: streamed step]) and stay there until the next step."""
        self._materialize()
        pieces = []
        for fset in self.sets:
            rep = fset.reduce_groups(self.groups).replicate
            views = [(span, view) for f, span, view in self.master_views if f is fset]
            for piece in fset.layout.local_pieces(fset.rank):
                slot, n, so = piece.slot, piece.hi - piece.lo, piece.shard_offset
                trainable = fset.key_of_bucket[slot.bucket] is not None
                if fset.master is not None and trainable:
                    value = fset.master[so:so + n]
                elif fset.partition is not None:  # int8 frozen shards: their decoded staging copy
                    value = fset.partition_piece(so, n)
                else:  # stages 0-2 in fp32: the master is the own shard of `full`
                    value = fset.full[slot.offset + piece.lo:slot.offset + piece.hi]
                key, offset = None, 0
                if trainable:
                    span, key = next((s, v) for s, v in views if s.lo <= so < s.hi)
                    offset = so - span.lo
                wlo, whi = even_part(piece.lo, piece.hi, rep.rank, rep.size)
                name = (slot.name if fset.experts is None
                        else global_expert_name(slot.name, fset.params[slot.index], self.mesh))
                pieces.append(HeldPiece(name, slot.shape, "param", piece.lo, piece.hi, wlo, whi,
                                        value, trainable, key, offset, rep if rep.size > 1 else None))
        return pieces

    def managed_params(self) -> list[torch.nn.Parameter]:
        """Every parameter this strategy manages (its FlatParamSets')."""
        return [p for fset in self.sets for p in fset.params]

    def manages(self, param: torch.Tensor) -> bool:
        rec = record_of(param)
        return rec is not None and rec.strategy is self

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype

    def precision_name(self) -> str:
        return self.precision.name

    def scaler_state(self) -> dict:
        return self.precision.scaler.state_dict()

    def load_scaler_state(self, state: dict) -> None:
        """Restore the scaler when the checkpoint's is of the same kind
        (fp16 -> fp16); a bf16 or fp32 checkpoint's leaves it as it is."""
        if set(state) == set(self.precision.scaler.state_dict()):
            self.precision.scaler.load_state_dict(state)

    def after_checkpoint_load(self) -> None:
        """The masters (and stage-3 frozen partitions) were overwritten by a
        load: cast them into the compute copy and bring every rank's full
        parameters back (collective, like the end of a step)."""
        for fset in self.sets:
            fset.write_back_master()
        self._after_step()
        self._settle()  # offloaded states go back to their tiers

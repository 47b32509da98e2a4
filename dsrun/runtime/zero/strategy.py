"""What every ZeRO stage (1-3) shares: the optimizer step on partitions.

A stage subclass builds its `FlatParamSet`s and decides where gradients are
reduced (`_backward_hooks`) and how parameters come back after the step
(`_after_step`); this base class does the rest, identically for all stages:
loss scaling, unscale, overflow check, global norm, clipping, the optimizer
step on the master partitions, memory accounting and full-tensor reads.

[Note: one small collective per step]
The global squared norm and the overflow flag travel together in one
all_reduce of a 2-element fp32 tensor, on every rank, every step, so no rank
branches on a local value before a collective. fp16 only: an overflow
(inf/nan anywhere, any rank) skips the optimizer step on all ranks, the
scaler shrinks, and the engine skips the LR scheduler (StepOutcome.applied).
"""
from __future__ import annotations

import logging
import math
import weakref

import torch

from dsrun.runtime import comm
from dsrun.runtime.data_parallel import GradientStrategy, StepOutcome
from dsrun.runtime.dist import Topology
from dsrun.runtime.memory import tensor_breakdown
from dsrun.runtime.precision import PrecisionPolicy
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.watchdog import Watchdog

log = logging.getLogger("dsrun.zero")

# id(param) -> (weak param, weak strategy): who manages a parameter (api.py).
_OWNERS: dict[int, tuple] = {}


def owner_of(param: torch.Tensor) -> "ZeroStrategy | None":
    """The ZeRO strategy managing `param`, or None."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


class ZeroStrategy(GradientStrategy):
    """Base of the ZeRO stages; see the module docstring.

    Subclasses set `self.sets` (list[FlatParamSet]) before calling
    `_bind_optimizer()`, and implement `backward`, `_after_step`,
    `_compute_storage(fset)`.
    """

    stage: int
    replicated = False  # True: every rank holds all gradients (stage 0 mixed precision)

    def __init__(self, optimizer: torch.optim.Optimizer, topology: Topology,
                 precision: PrecisionPolicy, group=None, watchdog_timeout: float | None = None):
        if any(optimizer.state.values()):
            raise ValueError("the optimizer already holds state; give ZeRO a freshly built optimizer "
                             "(load a checkpoint through the engine instead)")
        self.optimizer = optimizer
        self.topology = topology
        self.precision = precision
        self.group = group
        self.rank = comm.get_rank(group)
        self.world_size = comm.get_world_size(group)
        self.watchdog = Watchdog(self.rank, watchdog_timeout)
        self.sets: list[FlatParamSet] = []
        self.last_overflow_param: str | None = None
        self._owner: dict[int, tuple[FlatParamSet, int]] = {}

    # ---- construction helpers ------------------------------------------
    def _bind_optimizer(self) -> None:
        """Point the optimizer's param groups at the master partitions."""
        per_group: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        for fset in self.sets:
            for b, view in zip(fset.layout.buckets, fset.master_views):
                per_group[fset.group_of_bucket[b.index]].append(view)
            for slot in fset.layout.slots:
                p = fset.params[slot.index]
                self._owner[id(p)] = (fset, slot.index)
                _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(self))
        for group, views in zip(self.optimizer.param_groups, per_group):
            group["params"] = views

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

    def step(self, max_grad_norm: float) -> StepOutcome:
        scale = self.precision.scaler.scale
        fp16 = self.precision.compute_dtype == torch.float16
        grads = [g for fset in self.sets for g in fset.grad_views()]
        sq = torch.zeros((), dtype=torch.float32)
        for g in grads:
            sq += g.float().pow(2).sum()
        if self.replicated and self.rank != 0:
            sq.zero_()  # every rank holds the same full gradients: count them once
        stats = torch.stack([sq, torch.tensor(0.0)])
        if fp16:
            stats[1] = float(not all(bool(torch.isfinite(g).all()) for g in grads))
        with self.watchdog.waiting("all-reduce of the gradient norm (optimizer step)"):
            comm.all_reduce(stats, group=self.group)  # See [Note: one small collective per step].
        overflow = fp16 and (stats[1].item() > 0 or not math.isfinite(stats[0].item()))
        self.precision.scaler.update(overflow)  # raises LossScaleUnderflowError at the floor
        if overflow:
            self._report_overflow(scale)
            return StepOutcome(grad_norm=None, applied=False)
        norm = math.sqrt(stats[0].item()) / scale
        factor = 1.0 / scale
        if max_grad_norm > 0 and norm > max_grad_norm:
            factor *= max_grad_norm / (norm + 1e-6)
        for fset in self.sets:
            for master, grad in zip(fset.master_views, fset.grad_views()):
                g = grad if grad.dtype == master.dtype else grad.to(master.dtype)
                master.grad = g if factor == 1.0 else g * factor
        self.optimizer.step()
        for fset in self.sets:
            for master in fset.master_views:
                master.grad = None
        self._after_step()
        return StepOutcome(grad_norm=norm, applied=True)

    def _report_overflow(self, scale: float) -> None:
        local = None
        for fset in self.sets:
            for piece in fset.layout.local_pieces(fset.rank):
                g = fset.grad_partition[piece.shard_offset:piece.shard_offset + piece.hi - piece.lo]
                if not bool(torch.isfinite(g).all()):
                    local = (piece.slot.index, piece.slot.name)
                    break
            if local:
                break
        names = comm.all_gather_object(local[1] if local else None, group=self.group)
        self.last_overflow_param = next((n for n in names if n), None)
        if self.rank == 0:
            log.warning("fp16 gradient overflow (first in parameter %s); skipping step, loss scale "
                        "%g -> %g", self.last_overflow_param, scale, self.precision.scaler.scale)

    def _after_step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        for fset in self.sets:
            fset.grad_partition.zero_()

    # ---- state -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.precision.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.scaler.load_state_dict(state["scaler"])

    # ---- accounting and full-tensor reads ---------------------------------
    def _compute_storage(self, fset: FlatParamSet) -> list[torch.Tensor]:
        raise NotImplementedError

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds per category (params, grads, master,
        optimizer_states) and dtype, counting flat buffers whole (padding
        included). Step counters (0-dim tensors) are not counted."""
        states = [t for st in self.optimizer.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        return tensor_breakdown({
            "params": [t for f in self.sets for t in self._compute_storage(f)],
            "grads": [t for f in self.sets for t in self._grad_storage(f)],
            "master": [f.master for f in self.sets if f.master is not None and self.precision.mixed],
            "optimizer_states": states,
        })

    def _grad_storage(self, fset: FlatParamSet) -> list[torch.Tensor]:
        return [fset.grad_partition]

    def _full_from_partition(self, param: torch.nn.Parameter, pick) -> torch.Tensor | None:
        """Sum every rank's pieces of `param` read by pick(fset) -> partition
        tensor (collective: all ranks must call). None if param is not ours."""
        if id(param) not in self._owner:
            return None
        fset, idx = self._owner[id(param)]
        source = pick(fset)
        piece = fset.local_piece_tensor(source, idx)
        if not self.replicated:
            comm.all_reduce(piece, group=self.group)
        return piece

    def sync_master_from_params(self, params) -> None:
        """After `params` (full values, e.g. inside GatheredParameters) were
        modified identically on every rank, copy this rank's pieces of them
        into the master weights and, for stage 3, the compute partition."""
        for p in params:
            if id(p) not in self._owner:
                continue
            fset, idx = self._owner[id(p)]
            flat = p.detach().reshape(-1)
            for piece in fset.layout.local_pieces(fset.rank):
                if piece.slot.index != idx:
                    continue
                n = piece.hi - piece.lo
                for target in (fset.master, fset.partition):
                    if target is not None:
                        target[piece.shard_offset:piece.shard_offset + n].copy_(flat[piece.lo:piece.hi])

    def full_fp32_param(self, param):
        """Full fp32 master value of `param` (collective)."""
        return self._full_from_partition(param, lambda f: f.master_partition())

    def full_grad(self, param):
        """Full averaged gradient of `param` as fp32, unscaled (collective)."""
        scale = self.precision.scaler.scale
        out = self._full_from_partition(param, lambda f: f.grad_partition)
        return out if out is None or scale == 1.0 else out / scale

    def full_optimizer_state(self, param, key: str):
        """Full optimizer state `key` (e.g. "exp_avg") of `param` (collective)."""
        def pick(fset):
            part = torch.zeros(fset.layout.shard_numel, dtype=torch.float32,
                               device=fset.grad_partition.device)
            for b, view in zip(fset.layout.buckets, fset.master_views):
                st = self.optimizer.state.get(view, {})
                if key in st:
                    off = fset.layout.bucket_shard_offset(b)
                    part[off:off + view.numel()].copy_(st[key])
            return part
        return self._full_from_partition(param, pick)

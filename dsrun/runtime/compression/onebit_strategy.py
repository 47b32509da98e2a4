"""ZeRO stage 0 for optimizers that communicate themselves or need layer boundaries.

`CompressedCommStrategy` is the GradientStrategy for:
- the 1-bit optimizers (dsrun.runtime.fp16.onebit: OnebitAdam, ZeroOneAdam,
  OnebitLamb), which own gradient communication (see [Note: the optimizer
  owns gradient communication] in dsrun/runtime/fp16/onebit/base.py): before
  each synchronising backward it asks `optimizer.gradients_averaged()`;
  when True the gradients are all-reduced as at plain stage 0, when False
  backward only accumulates this rank's gradients and the optimizer's
  step exchanges compressed momenta. No gradient all-reduce happens then.
- layer-wise optimizers on 16-bit (Lamb, 1-bit LAMB), which need to know
  where each parameter lies in the flat master buffer (`set_segments`, see
  [Note: trust-ratio segments] in dsrun/ops/lamb.py).

It is the stage-0 machinery of PartitionedOptimizerStrategy (the (nobody,
data-parallel group) pair: every rank holds everything, fp32 master
weights and loss scaling for bf16/fp16, flat buffers), so fp32, bf16 and
fp16 all work. Under tensor or sequence parallelism the data-parallel group
is the mesh's data (or "sequence_data") axis, smaller than the job: the
gradients and the compressed momenta are averaged over it only.

[Note: norm and overflow with local gradients]
On a step whose gradients stayed local, the ranks' gradients differ. The
squared norms are summed over the ranks in one 1-element all-reduce, so
an inf/nan on any rank skips the step on every rank (fp16 loss scaling
works as usual), and the reported norm -- also the one gradient_clipping
uses -- is the root mean square of the ranks' local norms.

ZeRO stages 1-3 partition what these optimizers need whole (DeepSpeed:
"1bit-Adam is not compatible with ZeRO"); `build_compression_strategy`
refuses them with a ConfigError.
"""
from __future__ import annotations

import torch

from dsrun.ops.lamb import Segmented
from dsrun.runtime import comm
from dsrun.runtime.config import ConfigError
from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer
from dsrun.runtime.optim.precision import PrecisionPolicy
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.zero.stage12 import PartitionedOptimizerStrategy


def takes_over(cfg, optimizer: torch.optim.Optimizer) -> bool:
    """True when `build_compression_strategy` must build the strategy: a
    1-bit optimizer, or a layer-wise one (Lamb) whose parameters would be
    flattened (16-bit, or any ZeRO stage)."""
    if isinstance(optimizer, CompressedCommOptimizer):
        return True
    flattened = cfg.zero_optimization.stage > 0 or cfg.fp16.enabled or cfg.bf16.enabled
    return isinstance(optimizer, Segmented) and flattened


def build_compression_strategy(cfg, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                               topology: Topology, group=None, *, mesh: ParallelMesh) -> "CompressedCommStrategy":
    """The strategy for a 1-bit or layer-wise optimizer (see `takes_over`).
    `group`: the data-parallel process group gradients are averaged over
    and the optimizer's compressed all-reduce runs in (None: every rank;
    under tensor or sequence parallelism `mesh`'s data axis, or
    "sequence_data").

    Raises:
        ConfigError: ZeRO stage 1-3 (these optimizers need whole parameters
            and optimizer states on every rank); a layer-wise optimizer
            (Lamb, OneBitLamb) on a tensor-parallel `mesh` (its trust ratio
            would be that of a tensor shard, not of the layer).
    """
    if isinstance(optimizer, Segmented) and mesh.size("model") > 1:
        raise ConfigError(f"{type(optimizer).__name__} takes a trust ratio per layer, and tensor parallelism "
                          f"(degree {mesh.size('model')}) splits each layer over ranks, so it would see a "
                          "shard's ratio; use Adam/AdamW or OneBitAdam/ZeroOneAdam with tensor parallelism, "
                          "or drop tensor_parallel.autotp_size")
    stage = cfg.zero_optimization.stage
    if stage > 0:
        name = type(optimizer).__name__
        raise ConfigError(f"zero_optimization.stage={stage}: {name} needs every parameter and optimizer "
                          "state whole on every rank (its communication or its per-layer trust ratio "
                          "works on them), which ZeRO stages 1-3 partition; as in DeepSpeed, use it with "
                          "zero_optimization.stage 0 (bf16 and fp16 work there), or pick Adam/AdamW for ZeRO")
    zero = cfg.zero_optimization
    return CompressedCommStrategy(module, optimizer, topology, PrecisionPolicy.from_config(cfg),
                                  reduce_bucket_size=zero.reduce_bucket_size,
                                  sub_group_size=zero.sub_group_size, group=group, mesh=mesh)


class CompressedCommStrategy(PartitionedOptimizerStrategy):
    """Stage 0 whose gradient communication the optimizer may own (module docstring).

    Args:
        module, optimizer, topology, precision: as PartitionedOptimizerStrategy.
        reduce_bucket_size: elements per gradient all-reduce (warm-up) and
            per flat master span (each span is one compressed tensor).
        sub_group_size: as PartitionedOptimizerStrategy.
        group: the data-parallel process group (None = every rank): the
            replicate group, the optimizer's `comm_group`.
        mesh: the job's ParallelMesh (as PartitionedOptimizerStrategy).

    Raises:
        ValueError: a parameter group carries DeepSpeed's `exp_avg_mask`
            (dsrun derives the mask, see [Note: momentum masks]).
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, topology: Topology,
                 precision: PrecisionPolicy, reduce_bucket_size: int, sub_group_size: int = 1_000_000_000,
                 group=None, *, mesh: ParallelMesh):
        for i, param_group in enumerate(optimizer.param_groups):
            if "exp_avg_mask" in param_group:
                raise ValueError(f"optimizer param group {i} has an exp_avg_mask: dsrun's engine flattens the "
                                 "parameters and derives the momentum mask itself (elements whose gradient "
                                 "stayed zero through warm-up); remove exp_avg_mask")
        super().__init__(module, optimizer, topology, precision, stage=0, reduce_bucket_size=reduce_bucket_size,
                         allgather_bucket_size=reduce_bucket_size, sub_group_size=sub_group_size, group=group,
                         mesh=mesh)
        self._owner = optimizer if isinstance(optimizer, CompressedCommOptimizer) else None
        if self._owner is not None:
            self._owner.comm_group = self.groups.replicate.group
        if isinstance(optimizer, Segmented):
            for fset, span, view in self.master_views:
                optimizer.set_segments(view, [(piece.shard_offset - span.lo, piece.shard_offset - span.lo
                                               + piece.hi - piece.lo)
                                              for piece in fset.layout.local_pieces(fset.rank)
                                              if span.lo <= piece.shard_offset < span.hi])
        self._local = False  # gradients of the coming step stay on this rank

    def backward(self, loss: torch.Tensor, *, sync: bool, retain_graph: bool) -> None:
        if sync:
            self._local = self._owner is not None and not self._owner.gradients_averaged()
        if not self._local:
            super().backward(loss, sync=sync, retain_graph=retain_graph)
            return
        self.reducer.begin(launch=False)  # accumulate only: the optimizer communicates
        self._scale(loss).backward(retain_graph=retain_graph)

    def _global_sq_norm(self) -> float:
        """See [Note: norm and overflow with local gradients]."""
        local = super()._global_sq_norm()
        ranks = self.groups.replicate
        if not self._local or ranks.size == 1:
            return local
        total = torch.tensor([local], dtype=torch.float32, device=self.topology.device)
        with self.watchdog.waiting("all-reduce of the local gradient norms (1-bit optimizer step)"):
            comm.all_reduce(total, group=ranks.group)
        return float(total.item()) / ranks.size

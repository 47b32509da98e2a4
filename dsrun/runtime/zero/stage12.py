"""ZeRO stages 1 and 2: partitioned optimizer states (and gradients).

Every rank keeps the full parameters in the compute dtype, as views into one
flat buffer per optimizer param group, and owns one shard of every bucket:
fp32 master weights, optimizer states and (averaged) gradients for it.

- Stage 1 accumulates full gradients locally (accumulation dtype) across
  micro-steps and reduce-scatters them only at the accumulation boundary.
- Stage 2 reduce-scatters every micro-step, bucket by bucket while backward
  runs, into the owner's gradient partition; only the buckets in flight
  hold full gradients. See [Note: ordered reduction] in reducer.py.

After the optimizer step the owners' new weights are all-gathered back into
the flat buffers (buckets grouped up to allgather_bucket_size elements).
Traffic per step: Ψ reduce-scatter + Ψ all-gather = 2Ψ logical elements.
"""
from __future__ import annotations

import torch

from dsrun.runtime.comm.zero_collectives import all_gather_region
from dsrun.runtime.dist import Topology
from dsrun.runtime.precision import PrecisionPolicy
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.reducer import OrderedReducer, Region
from dsrun.runtime.zero.strategy import ZeroStrategy


class PartitionedOptimizerStrategy(ZeroStrategy):
    """ZeRO stage 1 or 2 (see module docstring).

    module: the model (its floating parameters and buffers are cast to the
    compute dtype). optimizer: a fresh torch optimizer over module's
    parameters; its param groups are rewritten to hold master shards.
    reduce_bucket_size / allgather_bucket_size: elements per collective.
    Raises ValueError for stage not in (1, 2) or an optimizer with state.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 topology: Topology, precision: PrecisionPolicy, stage: int,
                 reduce_bucket_size: int, allgather_bucket_size: int, group=None):
        if stage not in (0, 1, 2):
            raise ValueError(f"PartitionedOptimizerStrategy is stage 0, 1 or 2, got {stage}")
        super().__init__(optimizer, topology, precision, group)
        self.stage = stage
        # Stage 0 (only used for 16-bit precision) = one partition holding everything.
        self.replicated = stage == 0
        parts, part_rank = (1, 0) if self.replicated else (self.world_size, self.rank)
        self.module = module
        entries = self.trainable_groups(optimizer, module)
        by_group: dict[int, list] = {}
        for p, n, g in entries:
            by_group.setdefault(g, []).append((p, n))
        for g, members in sorted(by_group.items()):
            self.sets.append(FlatParamSet(
                f"group{g}", [p for p, _ in members], [n for _, n in members], [g] * len(members),
                part_rank, parts, precision, int(reduce_bucket_size), partition_params=False))
        if precision.mixed:
            # Frozen parameters and buffers follow the compute dtype (managed ones already do).
            module.to(precision.compute_dtype)
        self._bind_optimizer()
        regions = []
        self._full_grads: dict[int, torch.Tensor | None] = {}
        for fset in self.sets:
            full_grad = None
            if stage == 1:
                full_grad = torch.zeros(fset.layout.padded_numel, dtype=precision.grad_accum_dtype,
                                        device=fset.full.device)
            self._full_grads[id(fset)] = full_grad
            for b in fset.layout.buckets:
                staging = None if full_grad is None else full_grad[b.offset:b.offset + b.padded_numel]
                if self.replicated:
                    staging = fset.grad_partition[b.offset:b.offset + b.padded_numel]
                regions.append(Region(fset, [b], staging))
        # Backward produces gradients roughly in reverse registration order.
        regions.sort(key=lambda r: (-self.sets.index(r.fset), -max(s.index for s in r.slots)))
        self.reducer = OrderedReducer(regions, group, replicated=self.replicated,
                                      watchdog=self.watchdog)
        self._hooks = [p.register_post_accumulate_grad_hook(self.reducer.accumulate)
                       for fset in self.sets for p in fset.params]
        self._gather_plan = [(fset, _runs(fset, int(allgather_bucket_size))) for fset in self.sets]

    def backward(self, loss: torch.Tensor, *, sync: bool, retain_graph: bool) -> None:
        reduce_now = sync or self.stage == 2
        self.reducer.begin(launch=reduce_now)
        self._scale(loss).backward(retain_graph=retain_graph)
        if reduce_now:
            with self.watchdog.waiting("reduce-scatter of gradients (end of backward)"):
                self.reducer.flush()

    def _after_step(self) -> None:
        if self.replicated:
            for fset in self.sets:
                fset.write_back_master(fset.full)
            return
        handles = []
        for fset, runs in self._gather_plan:
            fset.write_back_master(fset.full)
            for buckets in runs:
                start = buckets[0].offset
                end = buckets[-1].offset + buckets[-1].padded_numel
                with self.watchdog.waiting("all-gather of updated parameters (after the step)"):
                    handles.append(all_gather_region(fset.layout, buckets, fset.full[start:end],
                                                     self.rank, self.group, async_op=True))
        with self.watchdog.waiting("all-gather of updated parameters (after the step)"):
            for h in handles:
                h.wait()  # parameters are complete on every rank after this

    def _compute_storage(self, fset: FlatParamSet) -> list[torch.Tensor]:
        return [fset.full]

    def _grad_storage(self, fset: FlatParamSet) -> list[torch.Tensor]:
        full = self._full_grads[id(fset)]
        return [fset.grad_partition] + ([full] if full is not None else [])


def _runs(fset: FlatParamSet, limit: int):
    """Consecutive buckets grouped up to `limit` elements per all-gather."""
    runs, current, size = [], [], 0
    for b in fset.layout.buckets:
        if current and size + b.padded_numel > limit:
            runs.append(current)
            current, size = [], 0
        current.append(b)
        size += b.padded_numel
    runs.append(current)
    return runs

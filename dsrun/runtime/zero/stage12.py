"""ZeRO stages 1 and 2 (and stage 0 in 16-bit): partitioned optimizer states (and gradients).

Every rank keeps the full parameters in the compute dtype, as views into one
flat buffer per optimizer param group, and owns one shard of every bucket:
fp32 master weights, optimizer states and averaged gradients for it.

- Stage 1 accumulates full gradients locally (accumulation dtype) across
  micro-steps, in one flat buffer, and reduce-scatters each bucket of it in
  place at the accumulation boundary; the rank's shard of that buffer is its
  gradient partition (no second copy).
- Stage 2 reduce-scatters every micro-step, bucket by bucket while backward
  runs, into the owner's gradient partition; only the buckets in flight
  hold full gradients. See [Note: ordered reduction] in reducer.py.
- Stage 0 with bf16/fp16 is the same machinery over the (nobody, world)
  group pair: one shard holding everything, gradients all-reduced in place.

After the optimizer step the owners' new weights are all-gathered back into
the flat buffers (buckets grouped up to allgather_bucket_size elements).
Traffic per step: Ψ reduce-scatter + Ψ all-gather = 2Ψ logical elements.

[Note: gathering while the step runs]
Both collectives are overlapped (see [Note: overlapped regions] in
collectives.py): the reduce-scatters run while backward goes on, and a
run of buckets is all-gathered as soon as the in-memory optimizer tier has
stepped its last bucket (`span_stepped`), while it steps the next ones.
`_after_step` issues whatever is left (the torch and NVMe tiers report no
spans) and waits for every gather, so when `step` returns the parameters
are complete on every rank, as before: nothing outside the step sees a
half-gathered buffer. Runs are issued in plan order whichever way, so
every rank's sequence of collectives is the same.
"""
from __future__ import annotations

import torch

from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.strategy.hooks import HookSet
from dsrun.runtime.offload.transfer import OFFLOAD_BUCKET_NUMEL
from dsrun.runtime.optim.precision import PrecisionPolicy
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.zero.collectives import all_gather_region
from dsrun.runtime.zero.experts import expert_name, expert_set_groups
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.groups import ZeroGroups
from dsrun.runtime.zero.init import restore_full
from dsrun.runtime.zero.params import home_device
from dsrun.runtime.zero.reducer import OrderedReducer, Region
from dsrun.runtime.zero.strategy import ZeroStrategy


class PartitionedOptimizerStrategy(ZeroStrategy):
    """ZeRO stage 0 (16-bit), 1 or 2 (see module docstring).

    module: the model (its floating parameters and buffers are cast to the
    compute dtype). optimizer: a fresh torch optimizer over module's
    parameters; its param groups are rewritten to hold master shards.
    reduce_bucket_size / allgather_bucket_size: elements per collective
    (gradient buckets of at most OFFLOAD_BUCKET_NUMEL when stage-2 gradients
    leave an accelerator for the offloaded optimizer, see [Note: offload
    copies] in offload/transfer.py).
    sub_group_size: elements per fused optimizer chunk.
    optimizer_tier: where masters and optimizer states live (offload/optimizer_tier.py).
    groups: the (shard, replicate) pair to use at stages 1-2 instead of
    sharding over `group` (MiCS: ZeroGroups.mics).
    mesh: the job's ParallelMesh (the expert parameters' groups).
    Raises ValueError for stage not in (0, 1, 2) or an optimizer with state.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 topology: Topology, precision: PrecisionPolicy, stage: int,
                 reduce_bucket_size: int, allgather_bucket_size: int, sub_group_size: int = 1_000_000_000,
                 group=None, optimizer_tier=None, groups: ZeroGroups | None = None, *, mesh: ParallelMesh):
        if stage not in (0, 1, 2):
            raise ValueError(f"PartitionedOptimizerStrategy is stage 0, 1 or 2, got {stage}")
        if stage == 0:
            groups = ZeroGroups.replicated(group)
        elif groups is None:
            groups = ZeroGroups.sharded(group)
        super().__init__(optimizer, topology, precision, groups, sub_group_size, optimizer_tier=optimizer_tier,
                         mesh=mesh)
        self.stage = stage
        self.module = module
        by_group: dict[tuple[int, str], list] = {}
        trainable = self.trainable_groups(optimizer, module)
        self._prepare_tier(trainable)
        for p, n, g in trainable:
            restore_full(p, groups.shard.group)  # built under zero.Init: full values back, once
            by_group.setdefault((g, expert_name(p) or ""), []).append((p, n, g))
        experts = {name: expert_set_groups(name, stage > 0, groups.data_parallel_size, mesh)
                   for name in sorted({name for _, name in by_group if name})}
        for (g, name), members in sorted(by_group.items()):
            device = home_device(members[0][0])
            grad_device = self.optimizer_tier.grad_device(device)
            # Gradients leaving the device (optimizer offload): buckets of at most OFFLOAD_BUCKET_NUMEL.
            bucket = reduce_bucket_size if grad_device == device or stage in (0, 1) \
                else min(reduce_bucket_size, OFFLOAD_BUCKET_NUMEL)
            own = experts.get(name)  # expert parameters: their own groups ([Note: expert partitions])
            fset = FlatParamSet(f"group{g}" + (f".{name}" if name else ""), members,
                                groups.shard if own is None else own.groups.shard, precision, bucket,
                                partition_params=False, grad_in_full=stage in (0, 1),
                                master_device=self._master_device(members[0][0]),
                                pin_memory=self.optimizer_tier.pin_memory,
                                grad_device=grad_device, experts=own)
            self.sets.append(fset)
            self._adopt(fset)
        if precision.mixed:
            # Frozen parameters and buffers follow the compute dtype (managed ones already do).
            module.to(precision.compute_dtype)
        self._bind_optimizer()
        regions = [Region(fset, [b], in_place=stage in (0, 1)) for fset in self.sets
                   for b in fset.layout.buckets]
        # Backward produces gradients roughly in reverse registration order.
        regions.sort(key=lambda r: (-self.sets.index(r.fset), -r.buckets[0].index))
        self.reducer = OrderedReducer(regions, groups, watchdog=self.watchdog,
                                      host_grads=self.optimizer_tier.host_grads)
        self._register_hooks()
        # Sets over one rank (everything at 16-bit stage 0) need no gather: the step wrote their copy.
        self._gather_plan = [(fset, _runs(fset, allgather_bucket_size)) for fset in self.sets
                             if fset.reduce_groups(groups).shard.size > 1]
        self._gathers: list = []  # handles of this step's gathers, in plan order
        self._next_gather = 0  # index of the next run to issue, over every set's runs in order
        self._plan = [(fset, buckets) for fset, runs in self._gather_plan for buckets in runs]

    def _register_hooks(self) -> None:
        """The gradient hook of every managed parameter: hands it to the reducer."""
        self.hooks = HookSet()
        for fset in self.sets:
            for p in fset.params:
                self.hooks.on_grad_accumulated(p, "dsrun::reduce_grad", self.reducer.accumulate)

    def backward(self, loss: torch.Tensor, *, sync: bool, retain_graph: bool) -> None:
        self.run_backward(lambda: self._scale(loss).backward(retain_graph=retain_graph), sync=sync)

    def run_backward(self, autograd_call, *, sync: bool) -> None:
        reduce_now = sync or self.stage == 2
        self.reducer.begin(launch=reduce_now)
        autograd_call()
        if reduce_now:
            with self.watchdog.waiting("reduce-scatter of gradients (end of backward)"):
                self.reducer.flush()

    def span_stepped(self, fset, span) -> None:
        """Issue the gathers of the runs whose buckets are all stepped now
        (see [Note: gathering while the step runs])."""
        if not self._plan:
            return
        stepped = (self.sets.index(fset), span.buckets[-1].index)  # the tier steps in plan order
        while self._next_gather < len(self._plan):
            run_set, buckets = self._plan[self._next_gather]
            if (self.sets.index(run_set), buckets[-1].index) > stepped:
                return  # its last bucket is not stepped yet
            self._issue_gather()

    def _issue_gather(self) -> None:
        fset, buckets = self._plan[self._next_gather]
        start, end = fset.layout.region(buckets)
        with self.watchdog.waiting("all-gather of updated parameters (after the step)"):
            self._gathers.append(all_gather_region(fset.layout, buckets, fset.full[start:end],
                                                   fset.reduce_groups(self.groups).shard, async_op=True))
        self._next_gather += 1

    def _after_step(self) -> None:
        if not self._plan:
            return  # every rank stepped all of it (the copy was written in the step)
        while self._next_gather < len(self._plan):
            self._issue_gather()
        handles, self._gathers, self._next_gather = self._gathers, [], 0
        with self.watchdog.waiting("all-gather of updated parameters (after the step)"):
            for h in handles:
                h.wait()  # parameters are complete on every rank after this


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

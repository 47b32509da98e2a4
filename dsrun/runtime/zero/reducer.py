"""Gradient reduction into partitions, in a fixed order, overlapped with backward.

[Note: ordered reduction]
A `Region` is a run of buckets of one FlatParamSet whose gradients travel in
one reduction (stages 0-2: one bucket; stage 3: one unit). Post-accumulate-
grad hooks add each parameter's gradient into the region's staging buffer
(accumulation dtype) and free `param.grad`. When a region is complete it is
launched asynchronously -- but only when every region before it in the
fixed order has been launched, so all ranks issue the same sequence of
collectives even if hooks fire in a different order on different ranks.
At most MAX_INFLIGHT launched regions are unfinished at a time: launching
one more first finishes (waits for, averages, frees) the oldest. `flush()`
(end of backward) launches the rest in order (parameters that got no
gradient contribute zeros) and finishes them all.

Two kinds of regions (see flat_params.py for where gradients live):
- in place (stage 1, 16-bit stage 0): staging is the set's persistent
  gradient buffer; the reduction leaves the sum in this rank's shard of it.
- transient (stages 2-3): staging is allocated when the region's first
  gradient arrives (each parameter's first gradient is copied in, slots
  that got none are zeroed at launch) and freed once reduced; the rank's
  averaged shard is added into `grad_partition`. At most the regions
  between the next one to launch and the ones whose hooks already fired
  hold staging memory.
With a communication dtype other than the accumulation dtype
(communication_data_type, by default the compute dtype) a cast copy of the
region is what travels, and the result is cast back when it is averaged.
With ZeRO++ qgZ (`quantize`) int4 travels whatever that dtype: the staging
buffer is quantized as it is, without the cast copy.
The averaging divides around the reduction as the precision policy's
`division` says (prescale_gradients, gradient_predivide_factor; see
[Note: dividing around the reduction] in optim/precision.py): the staging
buffer is divided before its launch (before any cast), the reduced shard
after.

When the gradient partition is in host memory (optimizer offload from an
accelerator) a finished region's reduced shard is not averaged on the
device: it goes to `host_grads` as it is, which copies it to the host and
averages it there (offload/transfer.py, [Note: offload copies]).
"""
from __future__ import annotations

from typing import Callable

import torch

from dsrun.runtime.zero.collectives import GradientQuantization, RegionHandle, reduce_region
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.groups import ZeroGroups
from dsrun.runtime.zero.partition import BucketSlot
from dsrun.runtime.zero.watchdog import Watchdog


class Region:
    """Buckets `buckets` (consecutive, trainable) of `fset`, reduced together.

    in_place: reduce inside the set's persistent gradient buffer (needs a
    single bucket unless the shard group is one rank).
    """

    def __init__(self, fset: FlatParamSet, buckets: list[BucketSlot], in_place: bool = False):
        self.fset = fset
        self.buckets = buckets
        self.start, self.end = fset.layout.region(buckets)
        self.part_lo = fset.layout.bucket_shard_offset(buckets[0])
        ids = {b.index for b in buckets}
        self.slots = [s for s in fset.layout.slots if s.bucket in ids]
        self.in_place = in_place
        self.staging: torch.Tensor | None = None
        self.ready: set[int] = set()
        self.handle: RegionHandle | None = None
        self.out: torch.Tensor | None = None
        if in_place:
            persistent = fset.grad_full if fset.grad_full is not None else fset.grad_partition
            if fset.layout.world_size > 1 and len(buckets) != 1:
                raise ValueError("an in-place region must be a single bucket")
            self.staging = persistent[self.start:self.end]

    def buffer(self) -> torch.Tensor:
        """The staging buffer, (end - start,), allocated on first use. Only
        the buckets' padding is zeroed then: each parameter's first gradient
        is copied in (`accumulate`), and `fill_missing` zeroes the slots that
        got none."""
        if self.staging is None:
            self.staging = torch.empty(self.end - self.start, dtype=self.fset.precision.grad_accum_dtype,
                                       device=self.fset.compute_device)
            for b in self.buckets:
                self.staging[b.offset + b.numel - self.start:b.offset + b.padded_numel - self.start].zero_()
        return self.staging

    def fill_missing(self) -> None:
        """Zero the slots of a transient staging buffer that no gradient
        reached (parameters unused in this backward) before it is reduced."""
        if self.in_place:
            return
        staging = self.buffer()
        for s in self.slots:
            if s.index not in self.ready:
                staging[s.offset - self.start:s.offset - self.start + s.numel].zero_()

    def own_shard(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a region-shaped `buffer` when the region is
        one bucket (where the reduction leaves it, in place), else a new
        (region / N,) tensor of buffer's dtype."""
        world = self.fset.layout.world_size
        if world == 1:
            return buffer
        if len(self.buckets) == 1:
            src, _, w = self.fset.layout.shard_spans(self.fset.rank, self.buckets)[0]
            return buffer[src - self.start:src - self.start + w]
        return torch.empty((self.end - self.start) // world, dtype=buffer.dtype, device=buffer.device)

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.slots)


class OrderedReducer:
    """Owns the regions, in launch order. See [Note: ordered reduction].

    groups: the (shard, replicate) pair the gradients are reduced over
    (a set of expert parameters has its own: FlatParamSet.reduce_groups).
    on_launched(region) is called right after a region's collective is
    issued (stage 3 releases the unit's gathered parameters there).
    watchdog: reports a launch that blocks too long (see watchdog.py).
    quantize: ZeRO++ qgZ (see reduce_region); None = full precision.
    host_grads: the optimizer tier's HostGradients when gradient partitions
    are in host memory (None: they are on the device).
    """

    # Regions reduced but not yet finished: each holds its staging buffer and
    # output until finished, so this bounds the gradient working set.
    MAX_INFLIGHT = 1

    def __init__(self, regions: list[Region], groups: ZeroGroups,
                 on_launched: Callable[[Region], None] | None = None, watchdog: Watchdog | None = None,
                 quantize: GradientQuantization | None = None, host_grads=None):
        self.regions = regions
        self.host_grads = host_grads
        self.groups = groups
        self.quantize = quantize
        self.on_launched = on_launched
        self.watchdog = watchdog or Watchdog(groups.shard.rank, 0)
        self.where: dict[int, tuple[Region, int]] = {}
        for r in regions:
            for s in r.slots:
                self.where[id(r.fset.params[s.index])] = (r, s.index)
        self.next = 0
        self.launch_enabled = True
        self.inflight: list[Region] = []

    def begin(self, launch: bool) -> None:
        """Start a backward: launch reductions as regions complete (launch=True)
        or only accumulate (stage 1 outside the accumulation boundary)."""
        self.launch_enabled = launch
        for region in self.regions:
            region.ready.clear()
        if self.host_grads is not None:
            self.host_grads.begin()

    def accumulate(self, param: torch.nn.Parameter) -> None:
        """Hook body: move param.grad into its region's staging buffer."""
        region, idx = self.where[id(param)]
        slot = region.fset.layout.slots[idx]
        lo = slot.offset - region.start
        target = region.buffer()[lo:lo + slot.numel]
        if region.in_place or idx in region.ready:
            target.add_(param.grad.reshape(-1))
        else:
            target.copy_(param.grad.reshape(-1))  # a transient buffer is not zeroed (see Region.buffer)
        param.grad = None  # the staging buffer holds it now
        region.ready.add(idx)
        if self.launch_enabled:
            self._launch_in_order()

    def _launch_in_order(self, force: bool = False) -> None:
        while self.next < len(self.regions):
            region = self.regions[self.next]
            if not (force or region.complete):
                return
            self._launch(region)
            self.next += 1

    def _launch(self, region: Region) -> None:
        # Issuing may block (synchronous transports such as shm): watched too.
        with self.watchdog.waiting(f"reduce-scatter of gradients of '{region.fset.name}'"):
            region.fill_missing()
            staging = region.buffer()
            before, _ = region.fset.precision.division.divisors(region.fset.average_over(self.groups))
            if before != 1.0:
                staging.div_(before)
            comm_dtype = staging.dtype if self.quantize is not None else region.fset.precision.comm_dtype
            # communication_data_type: send a 16-bit copy (region x 2 bytes, transient).
            send = staging if staging.dtype == comm_dtype else staging.to(comm_dtype)
            if send is not staging and not region.in_place:
                region.staging = None  # the copy is all that is needed from here on
            region.out = region.own_shard(send)
            region.handle = reduce_region(region.fset.layout, region.buckets, send, region.out,
                                          region.fset.reduce_groups(self.groups), async_op=True,
                                          quantize=self.quantize)
        if self.on_launched is not None:
            self.on_launched(region)
        self.inflight.append(region)
        while len(self.inflight) > self.MAX_INFLIGHT:
            self._finish(self.inflight.pop(0))

    def _finish(self, region: Region) -> None:
        """Wait for `region`'s reduction, average it into the gradient shards,
        free its buffers."""
        region.handle.wait()  # blocks until this region's sum arrived
        region.handle = None
        out, region.out = region.out, None
        fset = region.fset
        _, after = fset.precision.division.divisors(fset.average_over(self.groups))
        if region.in_place:
            target = region.own_shard(region.staging)
            if out.data_ptr() != target.data_ptr():
                target.copy_(out)
            if after != 1.0:
                target.div_(after)
            return
        target = fset.grad_partition[region.part_lo:region.part_lo + out.numel()]
        if fset.grads_offloaded:  # to host memory, averaged there
            self.host_grads.add(target, out, after)
        else:
            summed = out if out.dtype == target.dtype else out.to(target.dtype)
            if after != 1.0:
                summed.div_(after)
            target.add_(summed)
        region.staging = None

    def flush(self) -> None:
        """Launch what is left in order, finish everything and reset for the
        next backward."""
        self._launch_in_order(force=True)
        while self.inflight:
            self._finish(self.inflight.pop(0))
        if self.host_grads is not None:
            self.host_grads.drain()
        for region in self.regions:
            region.ready.clear()
        self.next = 0

"""Gradient reduction into partitions, in a fixed order, overlapped with backward.

[Note: ordered reduction]
A `Region` is a run of buckets of one FlatParamSet whose gradients travel in
one reduce-scatter (stage 1/2: one bucket; stage 3: one unit). Post-
accumulate-grad hooks add each parameter's gradient into the region's
staging buffer (accumulation dtype) and free `param.grad`. When a region is
complete it is launched asynchronously -- but only when every region before
it in the fixed order has been launched, so all ranks issue the same
sequence of collectives even if hooks fire in a different order on
different ranks. `flush()` (end of backward) launches the rest in order
(parameters that got no gradient contribute zeros), waits, and adds
result / N into each set's `grad_partition`.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.distributed import ProcessGroup

from dsrun.runtime import comm
from dsrun.runtime.comm.zero_collectives import RegionHandle, reduce_scatter_region
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.partition import BucketSlot
from dsrun.runtime.zero.watchdog import Watchdog


class Region:
    """Buckets `buckets` (consecutive) of `fset`, reduced together.

    staging: a persistent buffer to accumulate into (stage 1's full gradient
    buffer), or None to allocate a zeroed one per backward and free it after
    the reduction (stages 2-3).
    """

    def __init__(self, fset: FlatParamSet, buckets: list[BucketSlot],
                 staging: torch.Tensor | None = None):
        self.fset = fset
        self.buckets = buckets
        self.start = buckets[0].offset
        self.end = buckets[-1].offset + buckets[-1].padded_numel
        ids = {b.index for b in buckets}
        self.slots = [s for s in fset.layout.slots if s.bucket in ids]
        self.persistent = staging
        self.staging = staging
        self.ready: set[int] = set()
        self.handle: RegionHandle | None = None
        self.out: torch.Tensor | None = None

    def buffer(self) -> torch.Tensor:
        if self.staging is None:
            self.staging = torch.zeros(self.end - self.start, dtype=self.fset.grad_partition.dtype,
                                       device=self.fset.grad_partition.device)
        return self.staging

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.slots)


class OrderedReducer:
    """Owns the regions, in launch order. See [Note: ordered reduction].

    on_launched(region) is called right after a region's collective is
    issued (stage 3 releases the unit's gathered parameters there).
    watchdog: reports a launch that blocks too long (see watchdog.py).
    replicated: stage 0 with mixed precision -- layouts span one rank, each
    region's staging buffer IS the set's grad_partition, and it is
    all-reduced and averaged in place.
    """

    def __init__(self, regions: list[Region], group: ProcessGroup | None,
                 on_launched: Callable[[Region], None] | None = None, replicated: bool = False,
                 watchdog: Watchdog | None = None):
        self.regions = regions
        self.group = group
        self.on_launched = on_launched
        self.replicated = replicated
        self.watchdog = watchdog or Watchdog(comm.get_rank(group), 0)
        self.world_size = comm.get_world_size(group)
        self.where: dict[int, tuple[Region, int]] = {}
        for r in regions:
            for s in r.slots:
                self.where[id(r.fset.params[s.index])] = (r, s.index)
        self.next = 0
        self.launch_enabled = True

    def begin(self, launch: bool) -> None:
        """Start a backward: launch reductions as regions complete (launch=True)
        or only accumulate (stage 1 outside the accumulation boundary)."""
        self.launch_enabled = launch
        for region in self.regions:
            region.ready.clear()

    def accumulate(self, param: torch.nn.Parameter) -> None:
        """Hook body: move param.grad into its region's staging buffer."""
        region, idx = self.where[id(param)]
        slot = region.fset.layout.slots[idx]
        lo = slot.offset - region.start
        region.buffer()[lo:lo + slot.numel].add_(param.grad.reshape(-1))
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
            self._issue(region)

    def _issue(self, region: Region) -> None:
        fset = region.fset
        full = region.buffer()
        if self.replicated:
            region.out = full
            region.handle = RegionHandle(comm.all_reduce(full, group=self.group, async_op=True), None)
            return
        region.out = torch.empty((region.end - region.start) // fset.layout.world_size,
                                 dtype=full.dtype, device=full.device)
        region.handle = reduce_scatter_region(fset.layout, region.buckets, full, region.out,
                                              fset.rank, self.group, async_op=True)
        if self.on_launched is not None:
            self.on_launched(region)

    def flush(self) -> None:
        """Launch what is left in order, wait for everything, accumulate the
        averages into the grad partitions and reset for the next backward."""
        self._launch_in_order(force=True)
        for region in self.regions:
            region.handle.wait()  # blocks until this region's sum arrived
            region.handle = None
            region.ready.clear()
            if self.replicated:
                region.out.div_(self.world_size)
                region.out = None
                continue
            fset = region.fset
            lo = region.start // fset.layout.world_size
            target = fset.grad_partition[lo:lo + region.out.numel()]
            target.add_(region.out.div_(self.world_size))
            region.out = None
            if region.persistent is not None:
                region.persistent.zero_()
            else:
                region.staging = None
        self.next = 0

"""A stage-3 gather unit: parameters gathered with one collective, freed by resizing.

[Note: unit storage]
A unit owns one flat buffer `full` (padded_numel elements, the compute
dtype) for the gathered values of all its parameters. Its STORAGE is
resized to zero bytes when the unit is released and back to full size when
it is gathered again; the tensor object never changes. While gathered, each
parameter's `.data` is a view of `full`; while released it is a shared empty
tensor (so user code sees numel() == 0, as in DeepSpeed, instead of reading
freed memory). Autograd may save views of the gathered weights (e.g. the
transposed weight of a linear layer): those views share `full`'s storage,
so releasing frees their memory too -- nothing autograd holds keeps a unit's
bytes alive between forward and backward -- and gathering before backward
refills the very storage they point at. Writes into `full` bump `full`'s
version counter, not the parameters' (`.data` assignment keeps a
parameter's own counter), so autograd's saved-tensor checks still pass.
A gather that user code saw (GatheredParameters) is released by hand-off
instead: the unit takes a new, empty `full` and leaves the old storage to
whatever still references it (a tensor the user kept), so nothing a user
holds is resized under them.

[Note: unit life cycle]
    SHARDED --gather()--> GATHERING --wait()--> GATHERED --release()--> SHARDED
`gather` resizes the storage, writes this rank's shards and issues the
all-gather (async); `wait` completes it and points the parameters at it.
Persistent units (parameters below stage3_param_persistence_threshold) are
gathered after every optimizer step and never released.

[Note: hpZ secondary partition]
ZeRO++ hpZ (Wang et al. 2023, Section 3.2; zero_hpz_partition_size = h):
besides its primary shards (partitioned over every rank) a non-persistent
unit keeps `secondary`, this rank's 1/h of the unit's full buffer in the
compute dtype, the slice it owns among the h consecutive ranks of its hpZ
group (normally one node). The slices use the unit's own buckets split h
ways instead of world-size ways (`FlatLayout` over h ranks: every bucket is
padded to a multiple of the world size, so of h too). The secondary is
filled from `full` when a primary all-gather completes, so it holds the
values the forward computed with (qwZ's dequantized int8 ones included,
as in DeepSpeed), and a gather for backward (or a backward prefetch)
all-gathers the secondary slices within the hpZ group instead of the
world: exact, in the compute dtype, never quantized. The optimizer step,
a checkpoint load and GatheredParameters(modifier_rank=...) change the
partitions: they mark the secondary stale, and the next gather is primary
again. The secondary's bytes show in memory_breakdown() as hpz_secondary.

[Note: int8 frozen shards in a gather]
With zero_quantized_nontrainable_weights the unit's frozen buckets (the
tail of `full`) are stored as int8 (flat_params.py, [Note: int8 frozen
shards]) and gathered in a second all-gather of that int8 message over
the shard group, in forward and backward alike; the trainable buckets
(the head) are gathered as above. The secondary partition then covers the
trainable buckets only: frozen values cross the shard group in backward
too, but as int8 quantized once (a secondary would have to quantize the
decoded values a second time, and backward would then see other weights
than forward).
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass

import torch

from dsrun.runtime.offload.param_tier import ParamTier
from dsrun.runtime.zero.collectives import RegionHandle, all_gather_region, own_shard_views
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.groups import RankGroup
from dsrun.runtime.zero.params import ZeroParamStatus, record_of
from dsrun.runtime.zero.partition import FlatLayout
from dsrun.runtime.zero.watchdog import Watchdog


class UnitState(enum.Enum):
    SHARDED = "sharded"        # only the partition holds data; `full` has no storage
    GATHERING = "gathering"    # an all-gather into `full` is in flight
    GATHERED = "gathered"      # `full` holds every value; parameters are views of it


@dataclass(frozen=True)
class UnitContext:
    """What every unit of one stage-3 strategy shares, and all a unit sees of it.

    Attributes:
        shard: the group the primary partitions are sharded over (its
            all-gathers run there; `fset.layout` has shard.size ranks).
        hpz: this rank's ZeRO++ hpZ group, or None when hpZ is off (see
            [Note: hpZ secondary partition]).
        param_tier: where the partitions live (offload/param_tier.py); a
            gather reads an offloaded partition in through it.
        watchdog: reports a gather that waits too long (watchdog.py).
        weight_block: elements per int8 block of ZeRO++ qwZ for the
            training gathers; 0 = exact.
    """

    shard: RankGroup
    hpz: RankGroup | None
    param_tier: ParamTier
    watchdog: Watchdog
    weight_block: int = 0


class Unit:
    """One gather unit of stage 3 (see [Note: unit storage], [Note: unit life cycle]).

    index: position in the strategy's unit list. name: module name.
    modules: the modules whose forward needs it (hooks go there). fset: its
    parameters' FlatParamSet, partitioned over `context.shard` (built with
    partition_params=True). persistent: never released. context: the
    groups, tier, watchdog and qwZ block (UnitContext). With `context.hpz`
    set, a non-persistent unit keeps a secondary partition (see
    [Note: hpZ secondary partition]).

    Raises:
        ValueError: fset has no partition (a stage 0-2 set), or its layout
            is not over `context.shard`'s ranks.
    """

    def __init__(self, index: int, name: str, modules: list[torch.nn.Module], fset: FlatParamSet,
                 persistent: bool, context: UnitContext):
        if fset.partition is None:
            raise ValueError(f"unit {name!r}: its FlatParamSet keeps full parameters; a stage-3 unit needs "
                             "one built with partition_params=True")
        if fset.layout.world_size != context.shard.size:
            raise ValueError(f"unit {name!r}: its FlatParamSet is sharded over {fset.layout.world_size} ranks, "
                             f"the context's shard group has {context.shard.size}")
        self.index = index
        self.name = name
        self.modules = modules
        self.fset = fset
        self.persistent = persistent
        self.context = context
        self.state = UnitState.SHARDED
        self.handle: RegionHandle | None = None
        self._uploaded = None  # event of the copy from an offloaded partition (param_tier.uploading)
        # Gathered values live on the compute device, wherever the partition is (offload_param: host memory).
        dtype, device = fset.partition.dtype, fset.compute_device
        self._new_buffer()
        self._nbytes = self.full.element_size() * self.full.numel()
        self._empty = torch.empty(0, dtype=dtype, device=device)
        # Buckets gathered from the compute partition (all but int8 frozen ones) and their elements.
        buckets = fset.layout.buckets
        self._exact = [b for b, k in zip(buckets, fset.key_of_bucket) if k is not None or not fset.frozen_block]
        self._exact_numel = sum(b.padded_numel for b in self._exact)
        hpz = context.hpz
        slots = [s for s in fset.layout.slots if s.bucket < len(self._exact)]
        self._secondary_layout = (FlatLayout(slots, self._exact, hpz.size)
                                  if hpz is not None and not persistent and self._exact else None)
        # (padded_numel / h,) in the compute dtype, where `full` lives; see [Note: hpZ secondary partition]
        self.secondary = (torch.zeros(self._secondary_layout.shard_numel, dtype=dtype, device=device)
                          if self._secondary_layout is not None else None)
        self.secondary_valid = False
        self._fill_secondary = False  # the gather in flight is primary: keep its slice on completion

    def _new_buffer(self) -> None:
        """A new `full` (padded_numel,) with no bytes until gathered, and the
        parameter views of it."""
        part, layout = self.fset.partition, self.fset.layout
        self.full = torch.empty(layout.padded_numel, dtype=part.dtype, device=self.fset.compute_device)
        self._views = [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots]
        self.full.untyped_storage().resize_(0)

    def drop_values(self) -> None:
        """Free the parameters' original storage (the partition holds their
        shards now); call once their records point at this unit."""
        self._set_params(self._empty, ZeroParamStatus.NOT_AVAILABLE)

    @property
    def numel(self) -> int:
        """Elements of the gathered buffer (padding included)."""
        return self.fset.layout.padded_numel

    def _set_params(self, views, status: ZeroParamStatus) -> None:
        for i, p in enumerate(self.fset.params):
            p.data = views[i] if isinstance(views, list) else views
            record_of(p).set_status(status)

    def gather(self, phase: str) -> None:
        """SHARDED -> GATHERING: fill own shards and issue the all-gather
        (async): from the secondary partition within the hpZ group for a
        backward gather when it is valid, else from the primary partition
        over the shard group; int8 frozen shards in a second all-gather over
        the shard group (see [Note: int8 frozen shards in a gather])."""
        if self.state is not UnitState.SHARDED:
            return
        fset, shard = self.fset, self.context.shard
        secondary = self.secondary_valid and phase.startswith("backward")
        if secondary:
            layout, group, block = self._secondary_layout, self.context.hpz, 0
            reading, what = contextlib.nullcontext(), "hpZ all-gather"
        else:
            layout, group, block = fset.layout, shard, self._quantize_block(phase)
            reading, what = self.context.param_tier.resident(fset), "all-gather"  # NVMe: read it in
        exact, handles = self._exact, []
        uploading = contextlib.nullcontext() if secondary else self.context.param_tier.uploading(fset)
        self.full.untyped_storage().resize_(self._nbytes)  # allocated on the compute stream, before `uploading`
        with torch.no_grad(), uploading as self._uploaded:
            if exact:
                with reading:
                    source = self.secondary if secondary else fset.partition
                    for view, dst in own_shard_views(layout, exact, self.full, group.rank):
                        view.copy_(source[dst:dst + view.numel()], non_blocking=True)
            # Issuing may block too (synchronous transports such as shm).
            with self.context.watchdog.waiting(f"{what} of unit '{self.name}' ({phase})"):
                if exact:
                    handles.append(all_gather_region(layout, exact, self.full[:self._exact_numel], group,
                                                     async_op=True, quantize_block=block))
                if fset.frozen_block:  # see [Note: int8 frozen shards in a gather]
                    frozen = fset.layout.buckets[len(exact):]
                    handles.append(all_gather_region(fset.layout, frozen, self.full[self._exact_numel:], shard,
                                                     async_op=True, quantize_block=fset.frozen_block,
                                                     message=fset.frozen_message))
        self.handle = RegionHandle(handles)
        self._fill_secondary = self.secondary is not None and not secondary
        self.state = UnitState.GATHERING
        self._set_params(self._empty, ZeroParamStatus.INFLIGHT)

    def _keep_secondary(self) -> None:
        """Copy this rank's hpZ slice of the just gathered `full` into the
        secondary partition (see [Note: hpZ secondary partition])."""
        layout, hpz = self._secondary_layout, self.context.hpz
        with torch.no_grad():
            for view, dst in own_shard_views(layout, layout.buckets, self.full, hpz.rank):
                self.secondary[dst:dst + view.numel()].copy_(view)
        self.secondary_valid = True

    def invalidate_secondary(self) -> None:
        """The partitions changed (step, load, modified parameters): the next
        backward gathers from the primary partition again."""
        self.secondary_valid = False

    def _quantize_block(self, phase: str) -> int:
        """ZeRO++ qwZ block size for this gather, 0 for exact: only the
        training gathers (forward, backward, their prefetches) are quantized;
        persistent units and GatheredParameters get exact values."""
        training = phase.startswith(("forward", "backward")) and not self.persistent
        return self.context.weight_block if training else 0

    def wait(self, phase: str) -> None:
        """Any state -> GATHERED (gathers first when SHARDED)."""
        if self.state is UnitState.SHARDED:
            self.gather(phase)
        if self.state is UnitState.GATHERING:
            with self.context.watchdog.waiting(f"all-gather of unit '{self.name}' ({phase})"):
                self.handle.wait()  # blocks until every rank's shard arrived
            self.handle = None
            self.context.param_tier.wait_uploaded(self._uploaded)
            self._uploaded = None
            if self._fill_secondary:
                self._keep_secondary()
                self._fill_secondary = False
            self._set_params(self._views, ZeroParamStatus.AVAILABLE)
            self.state = UnitState.GATHERED

    def release(self, force: bool = False, hand_off: bool = False) -> None:
        """GATHERED -> SHARDED, freeing the gathered bytes (kept when
        persistent, unless forced). hand_off: user code saw the gathered
        values (GatheredParameters), so the storage is not resized but left
        to whoever still references it, and the unit takes a new buffer."""
        if self.state is UnitState.SHARDED or (self.persistent and not force):
            return
        if self.state is UnitState.GATHERING:
            self.wait("release")
        self._set_params(self._empty, ZeroParamStatus.NOT_AVAILABLE)
        if hand_off:
            self._new_buffer()
        else:
            self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

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

[Note: unit life cycle]
    SHARDED --gather()--> GATHERING --wait()--> GATHERED --release()--> SHARDED
`gather` resizes the storage, writes this rank's shards and issues the
all-gather (async); `wait` completes it and points the parameters at it.
Persistent units (parameters below stage3_param_persistence_threshold) are
gathered after every optimizer step and never released.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from dsrun.runtime.zero.collectives import RegionHandle, all_gather_region, own_shard_views
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.params import ZeroParamStatus, record_of

if TYPE_CHECKING:
    from dsrun.runtime.zero.stage3 import PartitionedParamStrategy


class UnitState(enum.Enum):
    SHARDED = "sharded"        # only the partition holds data; `full` has no storage
    GATHERING = "gathering"    # an all-gather into `full` is in flight
    GATHERED = "gathered"      # `full` holds every value; parameters are views of it


class Unit:
    """One gather unit of stage 3 (see [Note: unit storage], [Note: unit life cycle]).

    index: position in the strategy's unit list. name: module name.
    modules: the modules whose forward needs it (hooks go there). fset: its
    parameters' FlatParamSet. persistent: never released.
    """

    def __init__(self, index: int, name: str, modules: list[torch.nn.Module], fset: FlatParamSet,
                 persistent: bool, owner: "PartitionedParamStrategy"):
        self.index = index
        self.name = name
        self.modules = modules
        self.fset = fset
        self.persistent = persistent
        self.owner = owner
        self.state = UnitState.SHARDED
        self.handle: RegionHandle | None = None
        part = fset.partition
        self.full = torch.empty(fset.layout.padded_numel, dtype=part.dtype, device=part.device)
        self._nbytes = self.full.untyped_storage().nbytes()
        self._views = [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in fset.layout.slots]
        self.full.untyped_storage().resize_(0)  # no bytes until gathered
        self._empty = torch.empty(0, dtype=part.dtype, device=part.device)

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
        """SHARDED -> GATHERING: fill own shards and issue the all-gather (async)."""
        if self.state is not UnitState.SHARDED:
            return
        layout, fset = self.fset.layout, self.fset
        with torch.no_grad():
            self.full.untyped_storage().resize_(self._nbytes)
            with self.owner.param_tier.resident(fset):  # read from NVMe when offloaded there
                for view, dst in own_shard_views(layout, layout.buckets, self.full, fset.rank):
                    view.copy_(fset.partition[dst:dst + view.numel()])
            # Issuing may block too (synchronous transports such as shm).
            with self.owner.watchdog.waiting(f"all-gather of unit '{self.name}' ({phase})"):
                self.handle = all_gather_region(layout, layout.buckets, self.full, self.owner.groups.shard,
                                                async_op=True, quantize_block=self._quantize_block(phase))
        self.state = UnitState.GATHERING
        self._set_params(self._empty, ZeroParamStatus.INFLIGHT)

    def _quantize_block(self, phase: str) -> int:
        """ZeRO++ qwZ block size for this gather, 0 for exact: only the
        training gathers (forward, backward, their prefetches) are quantized;
        persistent units and GatheredParameters get exact values."""
        training = phase.startswith(("forward", "backward")) and not self.persistent
        return self.owner.quantized_weights_block if training else 0

    def wait(self, phase: str) -> None:
        """Any state -> GATHERED (gathers first when SHARDED)."""
        if self.state is UnitState.SHARDED:
            self.gather(phase)
        if self.state is UnitState.GATHERING:
            with self.owner.watchdog.waiting(f"all-gather of unit '{self.name}' ({phase})"):
                self.handle.wait()  # blocks until every rank's shard arrived
            self.handle = None
            self._set_params(self._views, ZeroParamStatus.AVAILABLE)
            self.state = UnitState.GATHERED

    def release(self, force: bool = False) -> None:
        """GATHERED -> SHARDED, freeing the gathered bytes (kept when
        persistent, unless forced)."""
        if self.state is UnitState.SHARDED or (self.persistent and not force):
            return
        if self.state is UnitState.GATHERING:
            self.wait("release")
        self._set_params(self._empty, ZeroParamStatus.NOT_AVAILABLE)
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

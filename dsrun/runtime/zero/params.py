"""One record per ZeRO-managed parameter, and DeepSpeed's `ds_*` attributes.

[Note: parameter records]
Every parameter that ZeRO manages (any stage, or built under zero.Init)
carries one `ZeroParam` as its attribute `_dsrun_zero`. The record says who
manages it (the strategy, weakly), where its elements live (its FlatParamSet
and slot) and, at stage 3, its gather unit; it is the only place that maps a
parameter to ZeRO state. There are no global tables keyed by id(param): a
record lives and dies with its parameter. (FSDP2 keeps the same per-parameter
record, `FSDPParam`.)

The records are the bottom of zero/: flat_params.py, strategy.py and unit.py
build on them, so this module imports none of them, not even for type
checking, and types its links to their objects as `Any` (each attribute's
documentation names the class).

DeepSpeed's attributes that scripts and Hugging Face read are set on the
parameter too: `ds_id` (int, unique per process), `ds_numel` (elements of the
full parameter), `ds_shape` (its torch.Size), `ds_persist` (stays gathered at
stage 3), `ds_status` (a `ZeroParamStatus`) and `ds_tensor` (this rank's
shard: a 1-D tensor of ceil(ds_numel / N) elements, padding at the end, the
compute dtype; at stages 1-2 the rank's piece of the parameter's bucket).
"""
from __future__ import annotations

import enum
import itertools
import weakref
from typing import Any

import torch

_IDS = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names for where a stage-3 parameter's full value is."""

    AVAILABLE = 1      # gathered: param.data is the full value
    NOT_AVAILABLE = 2  # released: param.data is empty, only ds_tensor holds data
    INFLIGHT = 3       # an all-gather into it was issued


class ZeroParam:
    """The ZeRO record of one parameter; see [Note: parameter records].

    Attributes:
        name: qualified name in its model ("" until a strategy adopts it).
        shape, numel: the full parameter's shape and element count.
        id: DeepSpeed's ds_id.
        init_shard: the zero.Init shard, (ceil(numel / N),) in the param's
            dtype, until a strategy adopts the parameter (then None).
        init_world_size: N of that shard (the shard group size of zero.Init).
        init_device: where zero.Init built the parameter and runs its
            collectives (the backend's device); the shard itself may live
            elsewhere (remote_device).
        init_full: True while `.data` holds the full value during zero.Init
            (see [Note: writes under zero.Init] in init_writes.py) or inside
            GatheredParameters; the shard is then possibly stale.
        fset, slot: the FlatParamSet (flat_params.py) and slot index holding
            it (once adopted).
        unit: the stage-3 gather `Unit` (unit.py); None at stages 0-2.
        strategy: the ZeroStrategy (strategy.py) managing it, held weakly.
    """

    def __init__(self, param: torch.nn.Parameter, shape: torch.Size):
        self._param = weakref.ref(param)
        self.name = ""
        self.shape = torch.Size(shape)
        self.numel = self.shape.numel()
        self.id = next(_IDS)
        self.init_shard: torch.Tensor | None = None
        self.init_world_size = 0
        self.init_device: torch.device | None = None
        self.init_full = False
        self.fset: Any = None
        self.slot = -1
        self.unit: Any = None
        self._strategy: weakref.ref | None = None
        param._dsrun_zero = self
        param.ds_id = self.id
        param.ds_numel = self.numel
        param.ds_shape = self.shape
        param.ds_persist = False
        param.ds_status = ZeroParamStatus.AVAILABLE

    @property
    def param(self) -> torch.nn.Parameter | None:
        return self._param()

    @property
    def strategy(self) -> Any:
        return self._strategy() if self._strategy is not None else None

    def adopt(self, strategy: Any, fset: Any, slot: int, name: str, unit: Any = None) -> None:
        """A strategy takes over the parameter: record where it lives now."""
        self._strategy = weakref.ref(strategy)
        self.fset, self.slot, self.name, self.unit = fset, slot, name, unit
        self.init_shard = None
        param = self.param
        param.ds_tensor = fset.shard_of_slot(slot)
        param.ds_persist = bool(unit is not None and unit.persistent)

    def set_status(self, status: ZeroParamStatus) -> None:
        param = self.param
        if param is not None:
            param.ds_status = status


def record_of(param: torch.Tensor) -> ZeroParam | None:
    """The ZeRO record of `param`, or None for a parameter ZeRO does not manage."""
    return getattr(param, "_dsrun_zero", None)


def home_device(param: torch.Tensor) -> torch.device:
    """The device `param` computes on: where zero.Init built it (its shard
    may be in host memory), else the device of its own data."""
    rec = record_of(param)
    if rec is not None and rec.init_shard is not None and rec.init_device is not None:
        return rec.init_device
    return param.device


def ensure_record(param: torch.nn.Parameter) -> ZeroParam:
    """The record of `param`, created (full shape = its current shape) if missing."""
    rec = record_of(param)
    return rec if rec is not None else ZeroParam(param, param.shape)

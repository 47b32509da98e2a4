"""A stage-3 gather unit on its own, in one process (dsrun/runtime/zero/unit.py).

A `Unit` sees its strategy only through a `UnitContext` (groups, parameter
tier, watchdog, qwZ block), so it is built here over a shard group of this
process alone (no communication: `RankGroup.alone()`), with a parameter
tier and a watchdog that record what the unit asks of them. The tests walk
[Note: unit life cycle] and check the parameters' values, storage and
DeepSpeed status at every state, the qwZ, hpZ and int8-frozen paths, and
what the unit tells the watchdog and the tier.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from dsrun.runtime.offload.param_tier import ParamTier
from dsrun.runtime.optim.precision import PrecisionPolicy
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.groups import RankGroup
from dsrun.runtime.zero.params import ZeroParamStatus, ensure_record
from dsrun.runtime.zero.policies import QWZ_BLOCK
from dsrun.runtime.zero.unit import Unit, UnitContext, UnitState
from dsrun.runtime.zero.watchdog import Watchdog


class RecordingWatchdog(Watchdog):
    """A watchdog that never watches (timeout 0) and keeps what it was told."""

    def __init__(self):
        super().__init__(rank=0, timeout=0)
        self.waits: list[str] = []

    @contextlib.contextmanager
    def waiting(self, what: str):
        self.waits.append(what)
        yield


class RecordingTier(ParamTier):
    """The in-memory parameter tier, recording the units' reads and uploads."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    @contextlib.contextmanager
    def resident(self, fset, write: bool = False):
        self.calls.append("resident")
        yield

    @contextlib.contextmanager
    def uploading(self, fset):
        self.calls.append("uploading")
        with super().uploading(fset) as done:
            yield done


class Strategy:
    """Stands for the strategy a parameter record points at (weakly; a unit never asks for it)."""


def _unit(persistent=False, weight_block=0, hpz=None, frozen_block=0, frozen=False, numel=600):
    """A unit over a weight (numel elements), a bias and optionally a frozen
    vector, with its records adopted and original storage dropped, as the
    stage-3 strategy builds one. Returns (unit, {name: original value}, context)."""
    torch.manual_seed(0)
    params = {"w": torch.nn.Parameter(torch.randn(numel // 4, 4)), "b": torch.nn.Parameter(torch.randn(7))}
    members = [(params["w"], "w", 0), (params["b"], "b", 0)]
    if frozen:
        params["f"] = torch.nn.Parameter(torch.randn(300), requires_grad=False)
        members.append((params["f"], "f", None))
    values = {n: p.detach().clone() for n, p in params.items()}
    fset = FlatParamSet("u", members, RankGroup.alone(), PrecisionPolicy(), 1, partition_params=True,
                        frozen_block=frozen_block)
    context = UnitContext(RankGroup.alone(), hpz, RecordingTier(), RecordingWatchdog(), weight_block)
    unit = Unit(0, "u", [], fset, persistent, context)
    owner = Strategy()
    for slot in fset.layout.slots:
        ensure_record(fset.params[slot.index]).adopt(owner, fset, slot.index, slot.name, unit)
    unit.drop_values()
    return unit, params, values, context


def _released(unit, params):
    assert unit.state is UnitState.SHARDED
    assert unit.full.untyped_storage().nbytes() == 0
    for p in params.values():
        assert p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE


def test_life_cycle_gathers_exact_values_and_frees_them():
    unit, params, values, context = _unit()
    _released(unit, params)
    assert unit.numel == unit.fset.layout.padded_numel >= 607
    unit.gather("forward")
    assert unit.state is UnitState.GATHERING
    assert unit.full.untyped_storage().nbytes() == unit.numel * 4
    assert all(p.ds_status is ZeroParamStatus.INFLIGHT and p.numel() == 0 for p in params.values())
    unit.gather("forward")  # issued already: nothing more
    unit.wait("forward")
    assert unit.state is UnitState.GATHERED
    for name, p in params.items():
        assert p.ds_status is ZeroParamStatus.AVAILABLE
        assert p.data_ptr() >= unit.full.data_ptr()  # a view of the unit's buffer
        torch.testing.assert_close(p.detach(), values[name], rtol=0, atol=0)
    unit.release()
    _released(unit, params)
    assert context.watchdog.waits == ["all-gather of unit 'u' (forward)"] * 2  # issue, then wait


def test_wait_on_a_sharded_unit_gathers_it_and_release_while_gathering_completes_first():
    unit, params, values, _ = _unit()
    unit.wait("backward")
    assert unit.state is UnitState.GATHERED
    torch.testing.assert_close(params["b"].detach(), values["b"], rtol=0, atol=0)
    unit.release()
    unit.gather("forward prefetch")
    unit.release()
    _released(unit, params)
    unit.release()  # released already: nothing
    _released(unit, params)


def test_persistent_unit_is_released_only_when_forced():
    unit, params, values, _ = _unit(persistent=True)
    unit.wait("persistent parameters")
    unit.release()
    assert unit.state is UnitState.GATHERED
    torch.testing.assert_close(params["w"].detach(), values["w"], rtol=0, atol=0)
    unit.release(force=True)
    _released(unit, params)


def test_hand_off_leaves_the_gathered_storage_to_whoever_holds_it():
    unit, params, values, _ = _unit()
    unit.wait("GatheredParameters")
    kept = params["w"].data
    old = unit.full
    unit.release(hand_off=True)
    assert unit.state is UnitState.SHARDED and params["w"].numel() == 0
    assert unit.full is not old and unit.full.untyped_storage().nbytes() == 0
    torch.testing.assert_close(kept, values["w"], rtol=0, atol=0)  # not resized under the user
    unit.wait("forward")
    torch.testing.assert_close(params["w"].detach(), values["w"], rtol=0, atol=0)


def test_qwz_asks_for_int8_in_training_gathers_only(monkeypatch):
    """On one rank nothing crosses a wire, so the all-gather is spied on:
    the block size the unit asks for is qwZ's decision."""
    from dsrun.runtime.zero import unit as unit_module

    asked = []
    real = unit_module.all_gather_region

    def spy(layout, buckets, full, group, async_op=False, quantize_block=0, message=None):
        asked.append(quantize_block)
        return real(layout, buckets, full, group, async_op=async_op, quantize_block=quantize_block,
                    message=message)

    monkeypatch.setattr(unit_module, "all_gather_region", spy)
    unit, params, values, _ = _unit(weight_block=QWZ_BLOCK)
    for phase in ("forward", "forward prefetch", "backward", "backward prefetch", "GatheredParameters"):
        unit.wait(phase)
        unit.release(hand_off=phase == "GatheredParameters")
    assert asked == [QWZ_BLOCK] * 4 + [0]
    torch.testing.assert_close(unit.fset.partition[:values["w"].numel()], values["w"].reshape(-1), rtol=0, atol=0)
    asked.clear()
    persistent, *_ = _unit(persistent=True, weight_block=QWZ_BLOCK)
    persistent.wait("forward")
    assert asked == [0]  # persistent units are gathered exactly
    asked.clear()
    exact, *_ = _unit()
    exact.wait("forward")
    assert asked == [0]


def test_hpz_backward_gathers_from_the_secondary_partition_the_forward_filled():
    unit, params, values, context = _unit(hpz=RankGroup.alone())
    assert unit.secondary is not None and not unit.secondary_valid
    unit.wait("forward")
    unit.release()
    assert unit.secondary_valid
    n = values["w"].numel()
    torch.testing.assert_close(unit.secondary[:n], values["w"].reshape(-1), rtol=0, atol=0)
    unit.secondary.mul_(2.0)  # mark what the backward gather reads
    context.param_tier.calls.clear()
    unit.wait("backward")
    assert context.param_tier.calls == []  # not read from the primary partition
    torch.testing.assert_close(params["w"].detach(), 2 * values["w"], rtol=0, atol=0)
    assert context.watchdog.waits[-2:] == ["hpZ all-gather of unit 'u' (backward)",
                                           "all-gather of unit 'u' (backward)"]
    unit.release()
    unit.invalidate_secondary()  # e.g. an optimizer step changed the partition
    unit.wait("backward")
    assert context.param_tier.calls == ["uploading", "resident"]
    torch.testing.assert_close(params["w"].detach(), values["w"], rtol=0, atol=0)  # the primary again
    unit.release()
    assert unit.secondary_valid  # refilled by that primary gather
    torch.testing.assert_close(unit.secondary[:n], values["w"].reshape(-1), rtol=0, atol=0)


def test_persistent_units_keep_no_secondary():
    unit, *_ = _unit(persistent=True, hpz=RankGroup.alone())
    assert unit.secondary is None


def test_int8_frozen_shards_are_gathered_decoded_and_trainable_ones_exact():
    unit, params, values, _ = _unit(frozen=True, frozen_block=QWZ_BLOCK)
    unit.wait("GatheredParameters")
    torch.testing.assert_close(params["w"].detach(), values["w"], rtol=0, atol=0)
    f = params["f"].detach()
    assert not torch.equal(f, values["f"])
    assert (f - values["f"]).abs().max() <= values["f"].abs().max() / 127


def test_unit_refuses_a_set_it_cannot_gather():
    w = torch.nn.Parameter(torch.randn(8))
    full = FlatParamSet("s", [(w, "w", 0)], RankGroup.alone(), PrecisionPolicy(), None, partition_params=False)
    context = UnitContext(RankGroup.alone(), None, ParamTier(), RecordingWatchdog())
    with pytest.raises(ValueError, match="partition_params=True"):
        Unit(0, "s", [], full, False, context)
    v = torch.nn.Parameter(torch.randn(8))
    fset = FlatParamSet("t", [(v, "v", 0)], RankGroup.alone(), PrecisionPolicy(), 1, partition_params=True)
    with pytest.raises(ValueError, match="sharded over 1 ranks, the context's shard group has 2"):
        Unit(0, "t", [], fset, False, UnitContext(RankGroup(None, 0, 2), None, ParamTier(), RecordingWatchdog()))

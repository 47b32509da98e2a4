"""User-facing ZeRO helpers with DeepSpeed's names.

`GatheredParameters` makes full parameters available (stage 3 gathers
their units; stages 0-2 already hold them), and with `modifier_rank`
publishes that rank's changes to every partition. `safe_get_full_*` read
full fp32 tensors from the partitions. All of them are collectives: every
rank must call them with the same parameters in the same order.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from dsrun.runtime import comm
from dsrun.runtime.zero import init as zinit
from dsrun.runtime.zero.params import record_of
from dsrun.runtime.zero.strategy import owner_of
from dsrun.runtime.zero.unit import UnitState


def _as_list(params) -> list[torch.nn.Parameter]:
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None,
                       enabled: bool = True) -> Iterator[None]:
    """Inside the block, `params` (a parameter or an iterable) hold full values.

    modifier_rank: None = read only (changes are discarded under stage 3);
    a rank = that rank's values after the block are broadcast and written
    into every rank's partition, master weights included. Works for
    parameters managed by any ZeRO stage, built under zero.Init, or plain.
    Only the units of `params` are gathered (load a big model module by
    module to keep the working set small). fwd_module is accepted for
    compatibility.

    What the block takes from a parameter stays valid after it (e.g.
    `kept = p.data.cpu()`, which on a CPU rank is the gathered storage
    itself, as DeepSpeed-Chat's save_zero_three_model keeps it): on exit
    the parameters' `.data` is swapped back to an empty tensor and the
    gathered storage is left to whoever still references it (freed when
    nobody does), never resized under them.
    """
    if not enabled:
        yield
        return
    params = _as_list(params)
    found = {}
    for p in params:
        rec = record_of(p)
        if rec is not None and rec.unit is not None:
            found[rec.unit.index] = rec.unit
    # Same order on every rank; a unit already gathered (in use by forward) stays so afterwards.
    units = [found[i] for i in sorted(found) if found[i].state is UnitState.SHARDED]
    init_only = [p for p in params if zinit.is_partitioned(p)]
    for unit in units:
        unit.wait("GatheredParameters")
    zinit.open_full(init_only)
    try:
        yield
    finally:
        if modifier_rank is not None:
            with torch.no_grad():
                for p in params:
                    comm.broadcast(p.data, src=modifier_rank)
                for p in params:
                    owner = owner_of(p)
                    if owner is not None:
                        owner.sync_master_from_params([p])
        zinit.close_full(init_only, modified=modifier_rank is not None)
        for unit in units:
            unit.release(hand_off=True)  # a tensor the user took from a parameter stays valid


def _owner(param):
    owner = owner_of(param)
    if owner is None:
        raise ValueError("this parameter is not managed by a ZeRO strategy (stage 1-3 or 16-bit "
                         "precision); read it directly")
    return owner


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """Full fp32 master value of `param` (its shape). Raises ValueError if unmanaged."""
    return _owner(param).full_fp32_param(param)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """Full averaged, unscaled fp32 gradient of `param` between backward and step."""
    return _owner(param).full_grad(param)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """Full fp32 optimizer state `optim_state_key` (e.g. "exp_avg") of `param`."""
    return _owner(param).full_optimizer_state(param, optim_state_key)

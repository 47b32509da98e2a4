"""Optimizers named in ds_config's `optimizer` section, with DeepSpeed's semantics.

Names are matched case-insensitively. "Adam" uses decoupled weight decay
(AdamW) unless `adam_w_mode: false`, as DeepSpeed's FusedAdam does by
default; "AdamW" always does. Both run dsrun's native Adam
(dsrun.ops.adam: DeepSpeedCPUAdam for CPU parameters, FusedAdam when any is
on a GPU) unless `torch_adam: true` asks for torch.optim.Adam/AdamW.
"Lion" is dsrun.ops.lion.Lion, "Lamb" dsrun.ops.lamb.FusedLamb (DeepSpeed's
class for that name). "OneBitAdam", "ZeroOneAdam" and "OneBitLamb" are the
communication-compressing optimizers of dsrun.runtime.fp16.onebit (the
engine then hands gradient communication to them, see
dsrun/runtime/compression/). Any other name is looked up in torch.optim.
Every parameter is checked against what the optimizer accepts, so a typo is
an error naming the accepted keys.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from dsrun.ops.adam import DeepSpeedCPUAdam, FusedAdam
from dsrun.ops.lamb import FusedLamb
from dsrun.ops.lion import Lion
from dsrun.runtime.config import ConfigError

__all__ = ["Lion", "build_optimizer"]


# DeepSpeed's Adam parameters that are not torch.optim.Adam(W) arguments.
_ADAM_DS_ONLY = {"torch_adam", "adam_w_mode", "bias_correction"}
_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad"} | _ADAM_DS_ONLY


def _check_keys(kind: str, params: dict[str, Any], accepted: Iterable[str]) -> None:
    accepted = sorted(accepted)
    for key in params:
        if key not in accepted:
            raise ConfigError(
                f"optimizer.params.{key}: not a parameter of optimizer {kind!r}; "
                f"accepted: {', '.join(accepted)}")


def _tensors(params: list) -> list[torch.Tensor]:
    """The tensors in a list of parameters, (name, parameter) pairs or group dicts."""
    out = []
    for item in params:
        group = item["params"] if isinstance(item, dict) else [item]
        group = [group] if isinstance(group, torch.Tensor) else group
        out += [t[1] if isinstance(t, tuple) else t for t in group]
    return out


def _build_adam(kind: str, params, options: dict[str, Any]) -> torch.optim.Optimizer:
    _check_keys(kind, options, _ADAM_KEYS)
    options = dict(options)
    adam_w_mode = bool(options.pop("adam_w_mode", True)) or kind == "adamw"
    torch_adam = bool(options.pop("torch_adam", False))
    bias_correction = bool(options.pop("bias_correction", True))
    amsgrad = bool(options.pop("amsgrad", False))
    # FusedAdam's defaults, which differ from torch.optim.AdamW's weight_decay=0.01.
    options.setdefault("lr", 1e-3)
    options.setdefault("weight_decay", 0.0)
    if torch_adam:
        if not bias_correction:
            raise ConfigError("optimizer.params.bias_correction: false needs dsrun's Adam, and torch_adam "
                              "is true (torch.optim.Adam always corrects); remove one of the two keys")
        # The fused kernel is ~5x faster than the per-tensor loop on CPU (REFERENCE.md
        # section 6: 62 ms vs 324-447 ms per 100M parameters), same update rule.
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        return cls(params, amsgrad=amsgrad, fused=True, **options)
    if amsgrad:
        raise ConfigError("optimizer.params.amsgrad: dsrun's native Adam (as DeepSpeed's) has no AMSGrad; "
                          "add \"torch_adam\": true to use torch.optim.Adam's, or remove amsgrad")
    # Group dicts are kept, but their "params" must be lists we can look at twice.
    params = [dict(p, params=list(p["params"]) if not isinstance(p["params"], torch.Tensor) else p["params"])
              if isinstance(p, dict) else p for p in params]
    if all(t.device.type == "cpu" for t in _tensors(params)):
        return DeepSpeedCPUAdam(params, adamw_mode=adam_w_mode, bias_correction=bias_correction, **options)
    return FusedAdam(params, adam_w_mode=adam_w_mode, bias_correction=bias_correction, **options)


def _torch_optimizer(name: str) -> type[torch.optim.Optimizer] | None:
    for attr in dir(torch.optim):
        obj = getattr(torch.optim, attr)
        if (attr.lower() == name and inspect.isclass(obj)
                and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer):
            return obj
    return None


def _accepted_args(cls: type) -> list[str]:
    sig = inspect.signature(cls.__init__)
    return [n for n, p in sig.parameters.items()
            if n not in ("self", "params") and p.kind is not p.VAR_KEYWORD]


def _onebit(cls_name: str):
    def load():
        from dsrun.runtime.fp16 import onebit  # imported on use: it needs dsrun.runtime.comm
        return getattr(onebit, cls_name)
    return load


# Lower-case config names of dsrun's own classes (besides Adam/AdamW), each a loader.
_DSRUN_OPTIMIZERS = {"lion": lambda: Lion, "lamb": lambda: FusedLamb, "onebitadam": _onebit("OnebitAdam"),
                     "zerooneadam": _onebit("ZeroOneAdam"), "onebitlamb": _onebit("OnebitLamb")}


def build_optimizer(opt_type: str, options: dict[str, Any], params) -> torch.optim.Optimizer:
    """Build the optimizer named `opt_type` with `options` over `params`.

    Args:
        opt_type: DeepSpeed's `optimizer.type` (case-insensitive): Adam,
            AdamW, Lion, Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb, or any
            torch.optim class name (SGD, Adagrad, ...).
        options: `optimizer.params` (lists are accepted where torch wants
            tuples, as JSON has no tuples).
        params: iterable of parameters or parameter-group dicts.

    Raises:
        ConfigError: unknown type or unknown parameter (the message lists
            the accepted ones).
    """
    name = opt_type.lower()
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    if name in ("adam", "adamw"):
        return _build_adam(name, params, options)
    cls = _DSRUN_OPTIMIZERS[name]() if name in _DSRUN_OPTIMIZERS else _torch_optimizer(name)
    if cls is None:
        known = sorted(["Adam", "AdamW", "Lion", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"] + [
            a for a in dir(torch.optim)
            if inspect.isclass(getattr(torch.optim, a))
            and issubclass(getattr(torch.optim, a), torch.optim.Optimizer)
            and a != "Optimizer"])
        raise ConfigError(f"optimizer.type: unknown optimizer {opt_type!r}; "
                          f"available: {', '.join(known)}")
    _check_keys(opt_type, options, _accepted_args(cls))
    return cls(params, **options)

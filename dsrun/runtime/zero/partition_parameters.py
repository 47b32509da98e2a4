"""`deepspeed.runtime.zero.partition_parameters`: the names scripts and
Hugging Face import from DeepSpeed's stage-3 parameter module.

`Init`, `GatheredParameters`, `ZeroParamStatus` and the external-parameter
functions are dsrun's (init.py, api.py, params.py, module_hints.py).
`zero_wrapper_for_fp_tensor_constructor` and `_orig_torch_arange` exist
because Hugging Face's `from_config` swaps the former while it builds a
model under `zero.Init`: DeepSpeed's Init wraps torch's tensor constructors
to create floating-point tensors in the config's dtype on the device.
dsrun's Init sets the device of factory calls with a device context instead
(see [Note: where zero.Init builds] in init.py) and does not cast to the
config's dtype, so swapping the wrapper changes nothing there; it is still
a working wrapper.
"""
from __future__ import annotations

import functools

import torch

from dsrun.accelerator import get_accelerator
from dsrun.runtime.zero.api import GatheredParameters
from dsrun.runtime.zero.init import Init, is_partitioned
from dsrun.runtime.zero.module_hints import register_external_parameter, unregister_external_parameter
from dsrun.runtime.zero.params import ZeroParamStatus, record_of

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "is_zero_param",
           "register_external_parameter", "unregister_external_parameter",
           "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange


def is_zero_param(parameter: torch.Tensor) -> bool:
    """True when ZeRO manages `parameter` or zero.Init partitioned it (it has ds_* attributes)."""
    return record_of(parameter) is not None or is_partitioned(parameter)


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype: torch.dtype, target_device=None):
    """Wrap a tensor constructor (torch.empty, torch.arange, ...) so that it
    creates on `target_device` (default: this rank's accelerator device)
    and casts floating-point results to `target_fp_dtype`."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None:
            kwargs["device"] = target_device or get_accelerator().current_device_name()
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped

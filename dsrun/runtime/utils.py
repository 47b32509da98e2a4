"""`deepspeed.runtime.utils`: helpers that DeepSpeed scripts import.

see_memory_usage, move_to_device, set_random_seed, clip_grad_norm_ and
ensure_directory_exists, with DeepSpeed's signatures. Memory figures come
from dsrun.accelerator (RSS on CPU, the allocator on CUDA).
"""
from __future__ import annotations

import os
import random

import psutil
import torch

from dsrun.accelerator import get_accelerator
from dsrun.runtime import comm
from dsrun.runtime.observability.logging import logger

_GiB = 2 ** 30


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log `message` with this process's device memory (allocated, peak,
    reserved) and the host's used memory, on rank 0. Like DeepSpeed, it
    does nothing unless force=True."""
    if not force or comm.get_rank() != 0:
        return
    acc = get_accelerator()
    vm = psutil.virtual_memory()
    logger.info(f"{message} | MA {acc.memory_allocated() / _GiB:.2f} GB  Max_MA "
                f"{acc.max_memory_allocated() / _GiB:.2f} GB  CA {acc.memory_reserved() / _GiB:.2f} GB  "
                f"Max_CA {acc.max_memory_reserved() / _GiB:.2f} GB | CPU Virtual Memory: used = "
                f"{(vm.total - vm.available) / _GiB:.2f} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()


def move_to_device(item, device: torch.device, criterion_func=None):
    """`item` (tensor or nested lists/tuples/dicts of them) with every tensor
    moved to `device`; with `criterion_func`, only tensors for which it
    returns True are moved."""
    if torch.is_tensor(item):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return type(item)({k: move_to_device(v, device, criterion_func) for k, v in item.items()})
    return item


def set_random_seed(seed: int) -> None:
    """Seed Python's, torch's (all devices) and, when installed, NumPy's generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)
    try:
        import numpy
    except ImportError:  # a plain install has no NumPy
        return
    numpy.random.seed(seed)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2, mpu=None) -> torch.Tensor:
    """Clip the gradients of `parameters` to a total norm of `max_norm`; return
    the norm before clipping. Without model parallelism (dsrun has none,
    so `mpu` must be None) this is torch.nn.utils.clip_grad_norm_.

    Raises:
        ValueError: mpu is given.
    """
    if mpu is not None:
        raise ValueError("clip_grad_norm_(mpu=...): dsrun has no model parallelism; pass mpu=None")
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def ensure_directory_exists(filename: str) -> None:
    """Create the directory that will hold `filename`."""
    os.makedirs(os.path.dirname(os.path.abspath(filename)), exist_ok=True)


def noop_decorator(func):
    return func

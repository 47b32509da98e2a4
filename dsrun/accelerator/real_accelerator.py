"""Which accelerator this process uses (`get_accelerator()`), chosen once.

DS_ACCELERATOR ("cpu" or "cuda") forces the choice, as in DeepSpeed;
otherwise CUDA when torch sees a GPU, else the CPU. The choice agrees with
the runtime's (dsrun.runtime.distributed.dist: nccl on CUDA, gloo on CPU).
"""
from __future__ import annotations

import os

import torch

from dsrun.accelerator.abstract_accelerator import DeepSpeedAccelerator

SUPPORTED = ("cpu", "cuda")
_current: DeepSpeedAccelerator | None = None


def _build(name: str) -> DeepSpeedAccelerator:
    if name == "cuda":
        from dsrun.accelerator.cuda_accelerator import CUDA_Accelerator
        return CUDA_Accelerator()
    from dsrun.accelerator.cpu_accelerator import CPU_Accelerator
    return CPU_Accelerator()


def get_accelerator() -> DeepSpeedAccelerator:
    """This process's accelerator (built on the first call).

    Raises:
        ValueError: DS_ACCELERATOR names a device dsrun does not support, or
            "cuda" when torch sees no GPU.
    """
    global _current
    if _current is None:
        name = os.environ.get("DS_ACCELERATOR", "").strip().lower()
        if name and name not in SUPPORTED:
            raise ValueError(f"DS_ACCELERATOR={name!r}: dsrun supports {', '.join(SUPPORTED)}; "
                             "unset it to pick CUDA when a GPU is visible, else the CPU")
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError("DS_ACCELERATOR=cuda but torch sees no CUDA device; unset it or set it to cpu")
        _current = _build(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    return _current


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    """Make `accel_obj` what get_accelerator() returns from now on."""
    global _current
    _current = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in SUPPORTED

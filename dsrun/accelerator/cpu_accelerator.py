"""The CPU as DeepSpeed's accelerator: gloo, synchronous kernels, host memory.

Memory queries answer for the process: "allocated" is its resident set
(RSS), the peak is the kernel's peak RSS (reset by reset_peak_memory_stats
where /proc allows it), total and available are the machine's RAM.
"""
from __future__ import annotations

import os

import psutil
import torch

from dsrun.accelerator.abstract_accelerator import DeepSpeedAccelerator, local_rank
from dsrun.runtime.memory import profile as memory_profile


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    """The host CPU (device "cpu", backend gloo)."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def is_synchronized_device(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # one device, whatever the index

    def set_device(self, device_index: int) -> None:
        """Nothing to select on the CPU."""

    def current_device(self) -> int:
        return local_rank()  # as DeepSpeed's CPU accelerator

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """Ranks on this node (LOCAL_WORLD_SIZE, else LOCAL_SIZE, else 1)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)

    def synchronize(self, device_index: int | None = None) -> None:
        """Kernels on the CPU are finished when they return."""

    def current_stream(self, device_index: int | None = None):
        return torch.cpu.current_stream()

    def default_stream(self, device_index: int | None = None):
        return torch.cpu.current_stream()

    @property
    def Event(self):
        return None  # as DeepSpeed's CPU accelerator: time with host timers (use_host_timers())

    def empty_cache(self) -> None:
        """The CPU allocator keeps no cache to drop."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        return memory_profile._read_rss()[0]

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return memory_profile._read_rss()[1]

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        memory_profile._reset_rss_peak()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self.max_memory_allocated()

    def memory_stats(self, device_index: int | None = None) -> dict:
        rss, peak = memory_profile._read_rss()
        return {"allocated_bytes.all.current": rss, "allocated_bytes.all.peak": peak}

    def total_memory(self, device_index: int | None = None) -> int:
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        return psutil.virtual_memory().available

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor  # pinning needs a GPU driver; host memory is what the CPU uses anyway

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def amp(self):
        return torch.cpu.amp

"""`DeepSpeedAccelerator`: the device interface of DeepSpeed's `get_accelerator()`.

The base class implements every method on top of one torch device module
(`torch.cuda`, `torch.cpu`); the CPU and CUDA subclasses
(cpu_accelerator.py, cuda_accelerator.py) override only what differs. Method
names, arguments and return values are DeepSpeed's, so code such as

    torch.randn(4, device=get_accelerator().current_device_name())
    get_accelerator().synchronize(); get_accelerator().max_memory_allocated()

runs unchanged on either device. Memory figures are bytes.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from dsrun.compat.missing import FeatureNotImplemented


class DeepSpeedAccelerator:
    """One device kind (see the module docstring).

    Attributes:
        _name: torch's device type ("cpu", "cuda").
        _communication_backend_name: torch.distributed backend ("gloo", "nccl").
        _compile_backend: torch.compile backend returned by get_compile_backend().
    """

    _name = "?"
    _communication_backend_name = "?"

    def __init__(self) -> None:
        self._compile_backend = "inductor"

    @property
    def _module(self):
        """The torch device module (torch.cuda, torch.cpu)."""
        return getattr(torch, self._name)

    # -- what kind of device --------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        """True when kernels finish before the call returns (no streams to wait for)."""
        return False

    def use_host_timers(self) -> bool:
        """Time with the host clock (synchronized devices) instead of device events."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def is_available(self) -> bool:
        return self._module.is_available()

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device: "nccl" or "gloo"."""
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return False

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float]
        out += [torch.bfloat16] if self.is_bf16_supported() else []
        out += [torch.half] if self.is_fp16_supported() else []
        return out

    # -- devices ---------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """"cuda" / "cuda:N" (or "cpu")."""
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        self._module.set_device(device_index)

    def current_device(self) -> int:
        return self._module.current_device()

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def device_count(self) -> int:
        return self._module.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        self._module.synchronize(device_index)

    # -- random numbers --------------------------------------------------------------------
    def random(self):
        """torch.random (DeepSpeed returns the module)."""
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return torch.default_generator

    # -- streams and events ----------------------------------------------------------------
    @property
    def Stream(self):
        return self._module.Stream

    def stream(self, stream):
        """Context manager making `stream` current."""
        return self._module.stream(stream)

    def current_stream(self, device_index: int | None = None):
        return self._module.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return self._module.current_stream(device_index)

    @property
    def Event(self):
        return functools.partial(torch.Event, device=self._name)

    # -- memory (bytes) --------------------------------------------------------------------
    def empty_cache(self) -> None:
        self._module.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._module.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._module.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict:
        return self._module.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._module.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._module.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._module.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        raise NotImplementedError

    def available_memory(self, device_index: int | None = None) -> int:
        raise NotImplementedError

    # -- tensors ---------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """`tensor` in page-locked host memory (where this device can pin)."""
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """True when `tensor` lives on this kind of device."""
        return tensor.device.type == self._name

    def _typed(self, dtype: torch.dtype):
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    BFloat16Tensor = property(lambda self: self._typed(torch.bfloat16))
    ByteTensor = property(lambda self: self._typed(torch.uint8))
    DoubleTensor = property(lambda self: self._typed(torch.double))
    FloatTensor = property(lambda self: self._typed(torch.float))
    HalfTensor = property(lambda self: self._typed(torch.half))
    IntTensor = property(lambda self: self._typed(torch.int))
    LongTensor = property(lambda self: self._typed(torch.long))

    # -- misc ------------------------------------------------------------------------------
    def amp(self):
        return self._module.amp

    def range_push(self, msg: str) -> None:
        """Open a named profiler range (NVTX on CUDA)."""

    def range_pop(self) -> None:
        """Close the last profiler range."""

    def lazy_call(self, callback) -> None:
        callback()

    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        """Graphs are not captured on this device: nothing to replay."""

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that select the visible devices."""
        return []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        """Prefixes of environment variables a launcher should pass to the ranks."""
        return []

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    def op_builder_dir(self) -> str:
        raise self._no_op_builder()

    def create_op_builder(self, class_name: str):
        raise self._no_op_builder()

    def get_op_builder(self, class_name: str):
        raise self._no_op_builder()

    def build_extension(self):
        raise self._no_op_builder()

    @staticmethod
    def _no_op_builder() -> FeatureNotImplemented:
        return FeatureNotImplemented(
            "get_accelerator().create_op_builder: DeepSpeed's op builders are not part of dsrun; its "
            "native ops are built on first use by dsrun.ops (see `dsrun-report`)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self._name!r}, backend={self._communication_backend_name!r})"


def local_rank() -> int:
    """LOCAL_RANK of this process (0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)

"""NVIDIA GPUs as DeepSpeed's accelerator: torch.cuda with NCCL."""
from __future__ import annotations

import torch

from dsrun.accelerator.abstract_accelerator import DeepSpeedAccelerator


class CUDA_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    """CUDA devices (device "cuda", backend nccl)."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_triton_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 7

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.default_generators[index]

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):
        return torch.cuda.Event

    def total_memory(self, device_index: int | None = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.mem_get_info(index)[0]

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback) -> None:
        torch.cuda._lazy_call(callback)

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        graph.replay()

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def export_envs(self) -> list[str]:
        return ["NCCL"]

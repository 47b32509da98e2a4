"""`deepspeed.utils.groups`: the process groups DeepSpeed code asks for.

dsrun trains data-parallel only, so the data-parallel group is the world
group, and the model-, sequence- and expert-parallel groups have one rank
(this one): their sizes are 1, their ranks 0 and their groups None, which
is what DeepSpeed reports when those parallelisms are off.
"""
from __future__ import annotations

import torch.distributed as dist

from dsrun.runtime import comm


def _get_data_parallel_group():
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return comm.get_world_size()


def _get_data_parallel_rank() -> int:
    return comm.get_rank()


def _get_model_parallel_group():
    return None


def _get_model_parallel_world_size() -> int:
    return 1


def _get_model_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group():
    return None


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_data_parallel_group():
    return _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def _get_expert_parallel_world_size(group_name: str | None = None) -> int:
    return 1


get_tensor_model_parallel_world_size = _get_model_parallel_world_size
get_tensor_model_parallel_rank = _get_model_parallel_rank
get_tensor_model_parallel_group = _get_model_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size

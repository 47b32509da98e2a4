"""`deepspeed.utils.groups`: the process groups DeepSpeed code asks for,
answered from the job's parallelism mesh (runtime/parallel/mesh.py
`current()`; the pure data-parallel mesh of the default group until the
runtime sets another).

DeepSpeed's meanings, which differ between the private and public names:

- `_get_model_parallel_*` ask the mpu (a PipelineParallelGrid) for its model
  parallel group: pipe x model, the ranks holding one model copy;
- the public `get_model_parallel_*` and `get_tensor_model_parallel_*` are
  tensor parallelism: the model axis;
- `_get_sequence_data_parallel_*`: data x sequence, ZeRO's group under
  sequence parallelism.

Expert parallelism is not part of the mesh yet: its world size is 1.
A group of one rank is a one-rank process group (ParallelMesh.group).
"""
from __future__ import annotations

from dsrun.runtime.parallel.mesh import current


def _get_data_parallel_group():
    return current().group("data")


def _get_data_parallel_world_size() -> int:
    return current().size("data")


def _get_data_parallel_rank() -> int:
    return current().rank("data")


def _get_data_parallel_group_ranks() -> list[int]:
    return list(current().ranks("data"))


def _get_model_parallel_group():
    return current().group("pipe_model")


def _get_model_parallel_world_size() -> int:
    return current().size("pipe_model")


def _get_model_parallel_rank() -> int:
    return current().rank("pipe_model")


def _get_sequence_parallel_group():
    return current().group("sequence")


def _get_sequence_parallel_world_size() -> int:
    return current().size("sequence")


def _get_sequence_parallel_rank() -> int:
    return current().rank("sequence")


def _get_sequence_data_parallel_group():
    return current().group("sequence_data")


def _get_sequence_data_parallel_world_size() -> int:
    return current().size("sequence_data")


def _get_sequence_data_parallel_rank() -> int:
    return current().rank("sequence_data")


def _get_broadcast_src_rank() -> int:
    """The global rank that broadcasts to the sequence-data-parallel group (its first)."""
    return current().ranks("sequence_data")[0]


def _get_expert_parallel_world_size(group_name: str | None = None) -> int:
    return 1


def get_tensor_model_parallel_group():
    return current().group("model")


def get_tensor_model_parallel_world_size() -> int:
    return current().size("model")


def get_tensor_model_parallel_rank() -> int:
    return current().rank("model")


get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank

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

- `_get_expert_*(group_name)`: the expert-parallel and expert-data-parallel
  groups of the MoE layers (runtime/parallel/expert/groups.py).
A group of one rank is a one-rank process group (ParallelMesh.group).
"""
from __future__ import annotations

from dsrun.runtime.parallel.expert.groups import create_expert_groups, expert_group_names, expert_groups
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


# Expert parallelism (runtime/parallel/expert/groups.py [Note: expert groups]):
# `group_name` is "ep_size_<P>", the name an MoE layer gives its expert
# parameters; asking for a name no layer made yet makes its groups (by the
# members of this rank's groups, which must all ask; DeepSpeed's
# _create_expert_and_data_parallel is collective over the job).

def _create_expert_and_data_parallel(expert_parallel_size_: int) -> None:
    """Make the expert-parallel and expert-data-parallel groups of degree
    `expert_parallel_size_` (every member of this rank's two groups must
    call it; other ranks need not)."""
    create_expert_groups(expert_parallel_size_, current())


def _get_expert_parallel_group(group_name: str):
    return expert_groups(group_name, current()).ep_group


def _get_expert_parallel_group_dict() -> dict:
    return {name: expert_groups(name, current()).ep_group for name in expert_group_names(current())}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return expert_groups(group_name, current()).expert_parallel.size


def _get_expert_parallel_rank(group_name: str) -> int:
    return expert_groups(group_name, current()).expert_parallel.rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The first global rank of this rank's expert-parallel group."""
    return expert_groups(group_name, current()).expert_parallel.ranks[0]


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(expert_groups(group_name, current()).expert_parallel.ranks)


def _get_expert_data_parallel_group(group_name: str):
    return expert_groups(group_name, current()).expert_data_group


def _get_expert_data_parallel_group_dict() -> dict:
    return {name: expert_groups(name, current()).expert_data_group for name in expert_group_names(current())}


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return expert_groups(group_name, current()).expert_data_parallel.size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return expert_groups(group_name, current()).expert_data_parallel.rank


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(expert_groups(group_name, current()).expert_data_parallel.ranks)


def _get_max_expert_size() -> int | None:
    """The largest expert-parallel degree made so far (None: no MoE layer)."""
    sizes = [expert_groups(name, current()).expert_parallel.size for name in expert_group_names(current())]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


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

"""Each sequence-parallel rank's slice of a sample: the data-side half of
Ulysses (the ranks of one sequence group read the same samples, since the
data loader shards over the data axis only, and each keeps its tokens)."""
from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import MeshGroup, current


def shard_sequence(tensor: torch.Tensor, dim: int = 1,
                   group: ProcessGroup | MeshGroup | None = None) -> torch.Tensor:
    """This rank's contiguous slice of `tensor` along the sequence dimension:
    of P sequence ranks, rank r keeps tokens [r N/P, (r+1) N/P).

    Args:
        tensor: any shape; `dim` is its sequence dimension of length N
            (e.g. input ids [b, N] with dim=1, or labels).
        dim: the sequence dimension.
        group: the sequence-parallel group (default: the current mesh's
            "sequence" axis).

    Returns:
        A view of `tensor`, N/P long along `dim`.

    Raises:
        ValueError: N is not a multiple of P. Ulysses needs equal slices
            (its all-to-all cuts equal blocks); pad the samples to a
            multiple of P and mask the padding out of the loss
            (sequence_parallel_loss's mask) and of attention.
    """
    if isinstance(group, MeshGroup):
        world, rank = group.size, group.rank
    elif group is None:
        record = current().axis_group("sequence")
        world, rank = record.size, record.rank
    else:
        world, rank = comm.get_world_size(group), comm.get_rank(group)
    length = tensor.shape[dim]
    if length % world:
        raise ValueError(f"shard_sequence: a sequence of {length} tokens cannot be split evenly over the "
                         f"{world} sequence-parallel ranks; pad it to a multiple of {world} (and mask the "
                         "padding out of the loss and attention) or change sequence_parallel_size")
    return tensor.narrow(dim, rank * (length // world), length // world)

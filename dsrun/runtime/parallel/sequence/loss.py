"""The loss of a sample whose tokens are split over the sequence-parallel
ranks, averaged over tokens rather than ranks.

[Note: the loss under sequence parallelism]
Under Ulysses each rank of a sequence group sees only its N/P tokens of
every sample, and the engine averages gradients over all data x sequence
ranks (ZeRO's sequence_data group), dividing by D * P. If each rank
returned the mean of its own tokens, the result would weigh every rank
equally, which is wrong whenever ranks hold different numbers of counted
tokens (padding, masked prompts: DeepSpeed issue #5248). The correct loss
of a replica is sum(loss * mask) / count over ALL its sequence ranks. So
each rank computes

    L_r = P * local_sum_r / total_count    (total_count summed over the group),

whose gradients, summed over the P ranks and divided by P by the engine,
are exactly the gradients of the replica's token mean; averaging over the
D replicas as well gives the data-parallel mean, as without sequence
parallelism. The value returned is the replica's token mean itself (equal
on every sequence rank, what the user logs), with L_r's gradient: value
and gradient come from one all-reduce of (sum, count) in forward, none in
backward.
"""
from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import MeshGroup, current


def sequence_parallel_loss(per_token_loss: torch.Tensor, mask: torch.Tensor | None = None,
                           group: ProcessGroup | MeshGroup | None = None) -> torch.Tensor:
    """The token mean of a loss over this rank's tokens and those of the
    other sequence ranks, for engine.backward (see [Note: the loss under
    sequence parallelism]).

    Args:
        per_token_loss: any shape, floating: this rank's per-token losses
            (e.g. cross_entropy(..., reduction="none")).
        mask: same shape, bool or 0/1: which tokens count (None: all).
        group: the sequence-parallel group (default: the current mesh's
            "sequence" axis).

    Returns:
        A 0-d tensor whose value is the mean over the counted tokens of the
        whole sequence group (equal on every sequence rank), and whose
        gradient is P * (this rank's masked sum) / (total count).

    Raises:
        ValueError: the mask's shape differs from the loss's, or no token of
            the whole sequence group is counted (the mean is undefined).
    """
    if isinstance(group, MeshGroup):
        group = group.group
    elif group is None:
        group = current().axis_group("sequence").group
    weights = (torch.ones_like(per_token_loss) if mask is None
               else mask.to(per_token_loss.dtype))
    if weights.shape != per_token_loss.shape:
        raise ValueError(f"sequence_parallel_loss: mask shape {tuple(mask.shape)} differs from the loss "
                         f"shape {tuple(per_token_loss.shape)}; give one mask entry per token")
    return _group_mean((per_token_loss * weights).sum(), weights.sum(), group,
                       "sequence_parallel_loss: the mask counts no token in the whole sequence group; "
                       "there is no mean to take (drop the sample or count at least one token)")


def _group_mean(local_sum: torch.Tensor, count: torch.Tensor, group: ProcessGroup | None,
                nothing_counted: str) -> torch.Tensor:
    """The token mean over `group` of `local_sum` (0-d, this rank's sum over its `count` tokens):
    one all-reduce of [sum, count]; value the group's mean, gradient W / total times local_sum's
    (W the group's size). Raises ValueError(nothing_counted) when the group counts no token."""
    totals = torch.stack([local_sum.detach().float(), count.float()])
    world = 1
    if group is not None:
        comm.all_reduce(totals, group=group)
        world = comm.get_world_size(group)
    if totals[1] <= 0:
        raise ValueError(nothing_counted)
    total = totals[1].to(local_sum.dtype)
    scaled = local_sum * world / total
    return scaled + (totals[0].to(local_sum.dtype) / total - scaled).detach()


def token_weighted_mean(mean_loss: torch.Tensor, count: torch.Tensor | int,
                        group: ProcessGroup | MeshGroup | None, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """A rank's mean loss over its `count` tokens turned into the token mean
    over every rank of `group` ([Note: the loss under sequence parallelism],
    with local_sum = mean_loss * count).

    Args:
        mean_loss: 0-d, this rank's mean over its counted tokens (e.g. a
            Hugging Face model's `loss`); NaN when count is 0 (0/0), in
            which case its value and gradient are not used.
        count: this rank's counted tokens (int or 0-d integer tensor).
        group: the ranks whose tokens are averaged together (the engine
            passes the mesh's "sequence_data" group, over which it also
            divides the gradients); None: this rank alone.
        fallback: a tensor of the model's graph used when count is 0, so
            that backward still reaches every parameter (ZeRO's gradient
            hooks must fire on every rank) with zero gradient; e.g. the
            logits. Required when count can be 0.

    Returns:
        0-d: value the token mean over the group (equal on its ranks),
        gradient W * count / total times mean_loss's (W the group's size).

    Raises:
        ValueError: the group counts no token, or this rank counts none and
            no fallback was given.
    """
    if isinstance(group, MeshGroup):
        group = group.group
    count = torch.as_tensor(count, device=mean_loss.device).to(torch.float32)
    has_tokens = bool(count > 0)
    local_sum = mean_loss * count.to(mean_loss.dtype) if has_tokens else None
    if local_sum is None:
        if fallback is None:
            raise ValueError("token_weighted_mean: this rank counts no token and no fallback tensor was given "
                             "to carry the (zero) gradient; pass e.g. the logits")
        local_sum = fallback.sum() * 0.0
    return _group_mean(local_sum, count, group,
                       "token_weighted_mean: no rank of the group counts a token (every label is -100); "
                       "there is no mean to take: drop the batch or count at least one token")

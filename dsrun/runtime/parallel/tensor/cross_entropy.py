"""Cross-entropy over logits split by vocabulary across the model group,
without gathering them (Megatron-LM, Shoeybi et al. 2019, Section 3: the
output embedding's GEMM stays parallel and the loss is fused with it, so
only b*s scalars cross the group instead of b*s*V logits).

[Note: the vocabulary-parallel cross-entropy]
With z the logits of one token split as z = [z_0 | z_1 | ...] over the
ranks and t its target,

    loss = log sum_j exp(z_j - m) - (z_t - m),    m = max_j z_j

Each rank computes its shard's max and the ranks take the maximum of those
(all-reduce MAX), so that every rank subtracts the same m and exp cannot
overflow. Then each rank has its shard's sum of exp(z_j - m) and, when t
is in its slice of the vocabulary, z_t - m (else 0); one all-reduce SUM of
those two per token gives both totals. The gradient with respect to the
logits is softmax(z) - onehot(t), which each rank forms for its own slice
from its exp(z_j - m) and the summed denominator: backward communicates
nothing. For b*s tokens that is one all-reduce of b*s fp32 values (MAX)
and one of 2*b*s (SUM), whatever the logits' dtype (computed in fp32).
"""
from __future__ import annotations

import torch

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import MeshGroup, ParallelMesh
from dsrun.runtime.parallel.tensor.layers import model_group
from dsrun.runtime.parallel.tensor.random import leave_split_region


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group: MeshGroup, ignore_index):
        ctx.dtype = logits.dtype
        logits = logits.float()
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        top = logits.max(dim=-1).values
        if group.size > 1:
            comm.all_reduce(top, op=comm.ReduceOp.MAX, group=group.group)
        shifted = logits - top.unsqueeze(-1)
        outside = (target < start) | (target >= start + per_rank)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        totals = torch.stack([exp.sum(dim=-1), picked])  # (2, ...): denominators, target logits
        if group.size > 1:
            comm.all_reduce(totals, group=group.group)
        loss = totals[0].log() - totals[1]
        ignored = target == ignore_index if ignore_index is not None else torch.zeros_like(outside)
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(totals[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside | ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, not_here, ignored = ctx.saved_tensors
        here = (~not_here).unsqueeze(-1).to(softmax.dtype)  # 1 where the target is in this slice
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -here)  # softmax - onehot(target)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 mesh: ParallelMesh | None = None,
                                 ignore_index: int | None = -100) -> torch.Tensor:
    """The per-token cross-entropy of logits split by vocabulary over the
    model group (see [Note: the vocabulary-parallel cross-entropy]); the
    full logits are never gathered.

    Args:
        logits_shard: (..., V/tp), this rank's slice [rank*V/tp,
            (rank+1)*V/tp) of the vocabulary (a ColumnParallelLinear's
            output without gather_output); any float dtype, computed in fp32.
        target: (...), integer class ids in [0, V), the same on every rank.
        mesh: the mesh whose model axis splits the vocabulary; the current
            one when None.
        ignore_index: tokens with this target get loss 0 and no gradient
            (as F.cross_entropy's); None for none.

    Returns:
        (...) fp32 losses, the same on every rank of the group; their mean
        is F.cross_entropy(full_logits, target) when no token is ignored
        (divide the sum by the number of tokens kept otherwise). The
        gradient flows to logits_shard only.

    Raises:
        ValueError: target's shape is not logits_shard's without its last
            dimension.
    """
    leave_split_region()  # the split logits end the forward: see random.py
    if tuple(target.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"vocab_parallel_cross_entropy: target has shape {tuple(target.shape)} but the "
                         f"logits {tuple(logits_shard.shape)} need {tuple(logits_shard.shape[:-1])}")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, model_group(mesh), ignore_index)

"""Embedding gradients reduced as rows (DeepSpeed's `sparse_gradients`).

[Note: sparse embedding gradients]
An embedding's gradient is zero outside the rows of the tokens a batch
looked up. With `sparse_gradients` the weight of every nn.Embedding and
nn.EmbeddingBag is averaged by sending only those rows: each rank takes
the row indices and rows of its gradient (a sparse COO gradient, as
`nn.Embedding(sparse=True)` makes, is coalesced; a dense one gives its rows
that are not all zero), every rank all-gathers the counts, then the
indices and rows padded to the largest count, and sums the gathered rows
into a coalesced sparse tensor. Traffic per rank is world x max rows x
(dim + 1) elements instead of the table's vocab x dim, a saving when
batches touch few rows. The averaging divides as the dense buckets do
(see [Note: dividing around the reduction] in optim/precision.py). A
gradient that was sparse stays sparse (coalesced: its values hold each row
once), a dense one gets the sum back as dense. Every rank takes part for
every weight, in the same order, also with no gradient (no rows).
DeepSpeed picks rows whose sum is non-zero, which drops a row whose
entries cancel; here a row is sent when any entry is non-zero.
"""
from __future__ import annotations

import torch

from dsrun.runtime import comm
from dsrun.runtime.optim.precision import GradientDivision


def embedding_weights(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable weights of every nn.Embedding and nn.EmbeddingBag in
    `module`, in registration order, each once (tied weights too)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.weight.requires_grad:
            seen.setdefault(id(sub.weight), sub.weight)
    return list(seen.values())


def _rows(grad: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices (n,) int64, rows (n, *like.shape[1:])) of a gradient of
    `like` (a weight of shape (vocab, ...)): its stored rows when sparse, its
    rows with a non-zero entry when dense, none when `grad` is None."""
    if grad is None:
        return (torch.zeros(0, dtype=torch.long, device=like.device),
                torch.zeros((0, *like.shape[1:]), dtype=like.dtype, device=like.device))
    if grad.is_sparse:
        grad = grad.coalesce()
        return grad.indices()[0], grad.values()
    index = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().flatten()
    return index, grad[index]


def _gather_padded(value: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """Every rank's `value` (its first dimension counts[rank]) concatenated
    in rank order: padded to the largest count, all-gathered, trimmed."""
    most, world = max(counts), len(counts)
    padded = value.new_zeros((most, *value.shape[1:]))
    padded[:value.shape[0]] = value
    out = value.new_empty((world * most, *value.shape[1:]))
    comm.all_gather_into_tensor(out.view(-1), padded.view(-1), group=group)
    parts = out.view(world, most, *value.shape[1:])
    return torch.cat([parts[r, :counts[r]] for r in range(world)])


def reduce_rows(param: torch.nn.Parameter, group, division: GradientDivision) -> None:
    """Average `param.grad` over `group` by its rows (see [Note: sparse
    embedding gradients]); collective over `group`, every rank must call it
    for the same parameters in the same order. Leaves `param.grad` a
    coalesced sparse tensor when it was sparse or None, the dense sum
    otherwise."""
    grad = param.grad
    index, rows = _rows(grad, param)
    world = comm.get_world_size(group)
    before, after = division.divisors(world)
    if before != 1.0:
        rows = rows / before
    count = torch.tensor([index.numel()], dtype=torch.long, device=param.device)
    counts = torch.empty(world, dtype=torch.long, device=param.device)
    comm.all_gather_into_tensor(counts, count, group=group)
    counts_list = [int(c) for c in counts.tolist()]
    if max(counts_list) > 0:  # every rank sees the same counts: all skip together
        index = _gather_padded(index, counts_list, group)
        rows = _gather_padded(rows.contiguous(), counts_list, group)
    summed = torch.sparse_coo_tensor(index.unsqueeze(0), rows, param.shape,
                                     check_invariants=False).coalesce()  # sums the ranks' rows
    if after != 1.0:
        summed = summed / after
    if grad is not None and not grad.is_sparse:
        grad.copy_(summed.to_dense())
    else:
        param.grad = summed


def norm_view(grad: torch.Tensor) -> torch.Tensor:
    """The entries of a gradient a norm or finiteness check reads: the
    values of a (coalesced) sparse gradient, the gradient itself otherwise."""
    return grad.values() if grad.is_sparse else grad


def held(grad: torch.Tensor | None) -> list[torch.Tensor]:
    """The dense tensors that hold a gradient, for memory accounting: a
    sparse gradient's indices and values, a dense gradient itself, nothing
    for None."""
    if grad is None:
        return []
    return [grad._indices(), grad._values()] if grad.is_sparse else [grad]

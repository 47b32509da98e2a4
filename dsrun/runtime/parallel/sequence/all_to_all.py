"""The two all-to-alls of Ulysses sequence parallelism as autograd-aware
functions: sequence-sharded q/k/v to head-sharded full-sequence q/k/v, and
the attention output back.

[Note: one all-to-all for q, k and v]
DeepSpeed Ulysses (Jacobs et al. 2023, arXiv 2309.14509, Section 3.1) gives
each of the P ranks of the sequence group N/P tokens of every head; before
attention an all-to-all regroups them so that each rank holds all N tokens
of h/P heads, and after attention a second all-to-all regroups the output
back to N/P tokens of every head. DeepSpeed issues three all-to-alls for
q, k and v; here the three go in one: each rank packs, for every
destination rank j, j's heads of q, k and v (flattened) side by side,

    send[j] = [ q heads of rank j | k heads of rank j | v heads of rank j ]
              for each of this rank's N/P tokens,

so one all_to_all_single along the first dimension delivers to rank j its
heads of all three, from every sequence slice in rank order. The receiver
puts the slices back in sequence order and cuts the three apart. The
bytes are those of three exchanges, the latency that of one.

An all-to-all with equal blocks is its own adjoint (the gradient of the
block rank i received from rank j goes back from i to j), so the backward
of each exchange is one all-to-all of the gradients: one for dq, dk and dv
together and one for the output's gradient.

Layouts (DeepSpeed's `batch_dim_idx`): 0 is [batch, sequence, heads,
head_dim], 1 is [sequence, batch, heads, head_dim]. Heads are always
dimension 2.

[Note: grouped-query attention under Ulysses]
With h query heads and h_kv key/value heads (h_kv divides h; query head i
uses key/value head i // (h / h_kv)), rank r gets query heads
[r h/P, (r+1) h/P). When P divides h_kv it also gets key/value heads
[r h_kv/P, (r+1) h_kv/P), which are exactly those its query heads use, so
local attention is again grouped-query attention with the same ratio.
When h_kv < P (and h_kv divides P) each key/value head is repeated P / h_kv
times before the exchange, so rank r gets one key/value head, r // (P /
h_kv), which is the one all its query heads use; the gradient of the
repeat sums the copies. Other combinations are refused.
"""
from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from dsrun.runtime import comm


def _exchange(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """all_to_all_single of a contiguous tensor along dimension 0."""
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Block j of dimension 0 goes to rank j; block i of the output came from
    rank i. Backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.group), None


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, world: int,
           batch_dim_idx: int) -> int:
    """Validate q/k/v for the exchange; returns how many times each key/value
    head is repeated (1 unless h_kv < P)."""
    if batch_dim_idx not in (0, 1):
        raise ValueError(f"DistributedAttention: batch_dim_idx={batch_dim_idx!r}; it must be 0 "
                         "([batch, sequence, heads, head_dim]) or 1 ([sequence, batch, heads, head_dim])")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"DistributedAttention: {name} has shape {tuple(t.shape)}; q, k and v must be "
                             "4-D, [batch, sequence, heads, head_dim] or [sequence, batch, heads, head_dim]")
    if key.shape[:3] != value.shape[:3] or query.shape[:2] != key.shape[:2]:
        raise ValueError(f"DistributedAttention: query {tuple(query.shape)}, key {tuple(key.shape)} and "
                         f"value {tuple(value.shape)} must agree on batch and sequence, and key and value "
                         "on the number of heads")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"DistributedAttention: q, k and v have dtypes {query.dtype}, {key.dtype}, "
                         f"{value.dtype}; they travel in one all-to-all, so give them one dtype")
    heads, kv_heads = query.shape[2], key.shape[2]
    if heads % world:
        raise ValueError(f"DistributedAttention: {heads} query heads cannot be split over the {world} ranks "
                         f"of the sequence-parallel group (Ulysses gives each rank heads/P whole heads); "
                         f"use a sequence_parallel_size that divides {heads}")
    if heads % kv_heads:
        raise ValueError(f"DistributedAttention: {heads} query heads and {kv_heads} key/value heads: "
                         "grouped-query attention needs the key/value heads to divide the query heads")
    if kv_heads % world == 0:
        return 1
    if world % kv_heads == 0:
        return world // kv_heads
    raise ValueError(f"DistributedAttention: {kv_heads} key/value heads over {world} sequence-parallel ranks: "
                     f"the ranks must divide the key/value heads or the key/value heads the ranks "
                     "(fewer heads than ranks are then replicated); change sequence_parallel_size")


def _pack(t: torch.Tensor, world: int) -> torch.Tensor:
    """[x0, x1, heads, d] -> [P, x0, x1, heads/P * d]: the heads of each
    destination rank first, flattened."""
    return t.unflatten(2, (world, t.shape[2] // world)).movedim(2, 0).flatten(3)


def _unpack(t: torch.Tensor, heads: int, seq_dim: int) -> torch.Tensor:
    """[P, x0, x1, c] received from every sequence slice -> the full sequence
    [.., P * n, .., heads, c / heads] in the caller's layout."""
    whole = t.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)
    return whole.unflatten(2, (heads, whole.shape[2] // heads))


def scatter_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: ProcessGroup,
                  world: int, batch_dim_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence-sharded q/k/v to head-sharded, full-sequence q/k/v in ONE
    all-to-all ([Note: one all-to-all for q, k and v]).

    Args:
        query: [b, n, h, d] (batch_dim_idx 0) or [n, b, h, d] (1): this
            rank's n = N/P tokens of every query head.
        key, value: the same with h_kv heads (see [Note: grouped-query
            attention under Ulysses]); value may have another head_dim.
        group: the sequence-parallel process group, of `world` ranks.

    Returns:
        (q, k, v) of shapes [b, N, h/P, d] (or [N, b, h/P, d]), and
        max(h_kv/P, 1) heads for k and v. Differentiable.

    Raises:
        ValueError: shapes, dtypes or head counts Ulysses cannot split.
    """
    repeat = _check(query, key, value, world, batch_dim_idx)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
    seq_dim = 1 - batch_dim_idx
    parts = [_pack(t, world) for t in (query, key, value)]
    sizes = [p.shape[-1] for p in parts]
    received = _AllToAll.apply(torch.cat(parts, dim=-1), group)
    q, k, v = received.split(sizes, dim=-1)
    return (_unpack(q, query.shape[2] // world, seq_dim), _unpack(k, key.shape[2] // world, seq_dim),
            _unpack(v, value.shape[2] // world, seq_dim))


def gather_heads(output: torch.Tensor, group: ProcessGroup, world: int, batch_dim_idx: int) -> torch.Tensor:
    """The attention output back: head-sharded full-sequence [b, N, h/P, d]
    (or [N, b, h/P, d]) to sequence-sharded [b, N/P, h, d] (or [N/P, b, h,
    d]), one all-to-all. Differentiable.

    Raises:
        ValueError: the output is not 4-D with the full sequence.
    """
    seq_dim = 1 - batch_dim_idx
    if output.dim() != 4:
        raise ValueError(f"DistributedAttention: the local attention returned shape {tuple(output.shape)}; "
                         "it must return [batch, sequence, heads, head_dim] (or [sequence, batch, heads, "
                         "head_dim] for batch_dim_idx=1) so that the heads can go back to their ranks")
    send = output.unflatten(seq_dim, (world, output.shape[seq_dim] // world)).movedim(seq_dim, 0)
    received = _AllToAll.apply(send, group)  # [P (head group), x0, x1, h/P, d]
    return received.movedim(0, 2).flatten(2, 3)

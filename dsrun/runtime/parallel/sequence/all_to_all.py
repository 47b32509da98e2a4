"""The two all-to-alls of Ulysses sequence parallelism as autograd-aware
functions: sequence-sharded q/k/v to head-sharded full-sequence q/k/v, and
the attention output back.

[Note: one all-to-all for q, k and v]
DeepSpeed Ulysses (Jacobs et al. 2023, arXiv 2309.14509, Section 3.1) gives
each of the P ranks of the sequence group N/P tokens of every head; before
attention an all-to-all regroups them so that each rank holds all N tokens
of its heads, and after attention a second all-to-all regroups the output
back to N/P tokens of every head. DeepSpeed issues three all-to-alls for
q, k and v; here the three go in one: each rank packs, for every
destination rank j, j's heads of q, k and v (flattened) one after the
other,

    send[j] = [ q heads of rank j | k heads of rank j | v heads of rank j ]
              for each of this rank's N/P tokens,

so one all_to_all_single delivers to rank j its heads of all three, from
every sequence slice in rank order. The receiver puts the slices back in
sequence order and cuts the three apart. The bytes are those of three
exchanges, the latency that of one. Which heads rank j gets is heads.py's
HeadPlan ([Note: heads the sequence-parallel size does not divide]): when
P does not divide the heads the blocks differ in size from rank to rank,
and the exchange is all_to_all_single with split sizes; every rank still
receives equal blocks (the same heads of every slice).

The adjoint of an all-to-all is the all-to-all with send and receive sizes
swapped (the gradient of the block rank i received from rank j goes back
from i to j), so the backward of each exchange is one all-to-all of the
gradients: one for dq, dk and dv together and one for the output's
gradient. A key/value head sent to two ranks gets the sum of both
gradients.

Layouts (DeepSpeed's `batch_dim_idx`): 0 is [batch, sequence, heads,
head_dim], 1 is [sequence, batch, heads, head_dim]. Heads are always
dimension 2.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed import ProcessGroup

from dsrun.runtime import comm
from dsrun.runtime.comm.list_collectives import all_to_all_single_split
from dsrun.runtime.parallel.sequence.heads import Range, plan_heads, query_heads

Layout = tuple[Sequence[Sequence[Range]], int, ProcessGroup, int]  # per-tensor head ranges, rank, group, sequence dim


def _exchange(send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
              group: ProcessGroup) -> torch.Tensor:
    """all_to_all_single of 1-D `send`: elements [sum(send_sizes[:j]), +send_sizes[j])
    go to rank j; returns what every rank sent here, in rank order. Equal
    blocks (P divides the heads) take the plain all-to-all."""
    recv = send.new_empty(sum(recv_sizes))
    if len(set(send_sizes)) == 1 and len(set(recv_sizes)) == 1:
        comm.all_to_all_single(recv, send, group=group)
    else:
        all_to_all_single_split(recv, send, recv_sizes, send_sizes, group=group)
    return recv


def _widths(tensors: Sequence[torch.Tensor], ranges: Sequence[Sequence[Range]]) -> list[list[int]]:
    """Elements per token of tensor t's heads for rank j: widths[t][j]."""
    return [[(stop - start) * t.shape[3] for start, stop in r] for t, r in zip(tensors, ranges)]


def _to_heads(tensors: Sequence[torch.Tensor], ranges: Sequence[Sequence[Range]], rank: int, group: ProcessGroup,
              seq_dim: int) -> list[torch.Tensor]:
    """This rank's n tokens of every head ([x0, x1, H_t, d_t] per tensor) to
    the whole sequence of its heads, ranges[t][rank], in one all-to-all:
    [.., P n, .., stop - start, d_t] per tensor."""
    world = len(ranges[0])
    tokens = tensors[0].shape[0] * tensors[0].shape[1]
    widths = _widths(tensors, ranges)
    send_sizes = [tokens * sum(w[j] for w in widths) for j in range(world)]
    send = tensors[0].new_empty(sum(send_sizes))
    blocks = iter(send.split([tokens * w[j] for j in range(world) for w in widths]))
    for j in range(world):  # one copy of each head into its destination's block
        for t, r in zip(tensors, ranges):
            start, stop = r[j]
            next(blocks).view(*t.shape[:2], stop - start, t.shape[3]).copy_(t[:, :, start:stop])
    mine = [tokens * w[rank] for w in widths]
    recv = _exchange(send, send_sizes, [sum(mine)] * world, group).view(world, -1)
    return [part.unflatten(1, (*t.shape[:2], -1, t.shape[3])).movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)
            for t, part in zip(tensors, recv.split(mine, dim=1))]


def _to_sequence(tensors: Sequence[torch.Tensor], heads: Sequence[int], ranges: Sequence[Sequence[Range]],
                 rank: int, group: ProcessGroup, seq_dim: int) -> list[torch.Tensor]:
    """The inverse direction: the whole sequence of this rank's heads
    ([.., P n, .., stop - start, d_t] per tensor) to this rank's n tokens of
    all heads[t] heads, [x0, x1, heads[t], d_t], in one all-to-all. A head
    received from several ranks (overlapping ranges) is their sum."""
    world = len(ranges[0])
    shape = list(tensors[0].shape[:2])
    shape[seq_dim] //= world
    tokens = shape[0] * shape[1]
    send = torch.cat([t.unflatten(seq_dim, (world, -1)).movedim(seq_dim, 0).flatten(1) for t in tensors], dim=1)
    widths = _widths(tensors, ranges)
    recv = _exchange(send.flatten(), [send.shape[1]] * world,
                     [tokens * sum(w[j] for w in widths) for j in range(world)], group)
    out = [t.new_empty(*shape, h, t.shape[3]) for t, h in zip(tensors, heads)]
    blocks = iter(recv.split([tokens * w[j] for j in range(world) for w in widths]))
    for j in range(world):
        for o, r in zip(out, ranges):
            start, stop = r[j]
            block = next(blocks).view(*shape, stop - start, o.shape[3])
            # ranges ascend, so ranks before j wrote exactly the heads below r[j - 1]'s stop
            seen = max(0, min(stop, r[j - 1][1]) - start) if j else 0
            o[:, :, start:start + seen] += block[:, :, :seen]
            o[:, :, start + seen:stop].copy_(block[:, :, seen:])
    return out


class _ToHeads(torch.autograd.Function):
    """_to_heads forward, _to_sequence (its adjoint) backward."""

    @staticmethod
    def forward(ctx, layout: Layout, *tensors: torch.Tensor):
        ctx.layout, ctx.heads = layout, [t.shape[2] for t in tensors]
        return tuple(_to_heads(tensors, *layout))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *_to_sequence(grads, ctx.heads, *ctx.layout))


class _ToSequence(torch.autograd.Function):
    """_to_sequence forward, _to_heads (its adjoint) backward."""

    @staticmethod
    def forward(ctx, layout: Layout, heads: int, tensor: torch.Tensor):
        ctx.layout = layout
        return _to_sequence([tensor], [heads], *layout)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, _to_heads([grad], *ctx.layout)[0]


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int) -> None:
    """Validate q/k/v shapes, layout and dtypes for the exchange (head
    counts: plan_heads)."""
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


def scatter_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: ProcessGroup,
                  world: int, batch_dim_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence-sharded q/k/v to head-sharded, full-sequence q/k/v in ONE
    all-to-all ([Note: one all-to-all for q, k and v]).

    Args:
        query: [b, n, h, d] (batch_dim_idx 0) or [n, b, h, d] (1): this
            rank's n = N/P tokens of every query head.
        key, value: the same with h_kv heads (h_kv divides h); value may
            have another head_dim.
        group: the sequence-parallel process group, of `world` ranks.

    Returns:
        (q, k, v) of shapes [b, N, h_r, d] (or [N, b, h_r, d]) with h_r
        this rank's query heads (h/P when P divides h, else h // P or one
        more: heads.py's plan_heads), and for k and v the key/value heads
        they use, as ordinary grouped-query attention (h_r divisible by
        them). Differentiable.

    Raises:
        ValueError: shapes, dtypes or head counts Ulysses cannot split
            (more ranks than query heads; h_kv not dividing h).
    """
    _check(query, key, value, batch_dim_idx)
    plan = plan_heads(query.shape[2], key.shape[2], world)
    rank = comm.get_rank(group)
    layout = ((plan.query, plan.kv, plan.kv), rank, group, 1 - batch_dim_idx)
    q, k, v = _ToHeads.apply(layout, query, key, value)
    index = plan.kv_index[rank]
    if index is not None:  # not the usual grouping: one key/value head per query head
        index = torch.tensor(index, device=k.device)
        k, v = k.index_select(2, index), v.index_select(2, index)
    return q, k, v


def gather_heads(output: torch.Tensor, heads: int, group: ProcessGroup, world: int,
                 batch_dim_idx: int) -> torch.Tensor:
    """The attention output back: head-sharded full-sequence [b, N, h_r, d]
    (or [N, b, h_r, d]; this rank's heads of scatter_heads) to
    sequence-sharded [b, N/P, h, d] (or [N/P, b, h, d]), one all-to-all.
    Differentiable.

    Args:
        heads: h, the query heads of all ranks together.

    Raises:
        ValueError: the output is not 4-D with the full sequence.
    """
    if output.dim() != 4:
        raise ValueError(f"DistributedAttention: the local attention returned shape {tuple(output.shape)}; "
                         "it must return [batch, sequence, heads, head_dim] (or [sequence, batch, heads, "
                         "head_dim] for batch_dim_idx=1) so that the heads can go back to their ranks")
    layout = ((query_heads(heads, world),), comm.get_rank(group), group, 1 - batch_dim_idx)
    return _ToSequence.apply(layout, heads, output)

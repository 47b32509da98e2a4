"""The communication of tensor parallelism as autograd functions: each moves
a tensor into or out of a tensor-parallel region in forward and does the
conjugate collective in backward.

[Note: the conjugate operators]
Megatron-LM (Shoeybi et al. 2019, Section 3, Figure 3) splits an MLP as
Y = GeLU(X A) with A split by columns, then Z = Y B with B split by rows.
Every rank of the model group holds all of X, so the column layer needs no
communication in forward; but each rank's part of dL/dX is only the sum over
its own columns, so backward must all-reduce it. The row layer produces a
partial sum of Z on each rank, so forward must all-reduce; its backward
gets the whole dL/dZ on every rank and needs nothing. These are the paper's
f and g:

    copy_to_region       (f)  forward identity     backward all-reduce
    reduce_from_region   (g)  forward all-reduce   backward identity

and, for a layer whose input or output is not split:

    scatter_to_region         forward keep this rank's slice of the last dim
                              backward all-gather the last dim
    gather_from_region        forward all-gather the last dim
                              backward keep this rank's slice

Sequence parallelism (Korthikanti et al. 2022, Section 4.2.2, Figure 6)
keeps the activations between the layers (LayerNorm, dropout, residual)
split along the sequence instead of replicated: g becomes a reduce-scatter
along the sequence (each rank keeps the sum for its tokens) and f an
all-gather along the sequence; an all-reduce is exactly a reduce-scatter
followed by an all-gather, so the traffic is the same and the memory of
those activations drops by the tensor-parallel degree:

    gather_from_sequence_region          forward all-gather along the sequence
                                         backward reduce-scatter (or slice)
    reduce_scatter_to_sequence_region    forward reduce-scatter along the sequence
                                         backward all-gather
    scatter_to_sequence_region           forward keep this rank's tokens
                                         backward all-gather

Every function takes the MeshGroup of the model axis (mesh.axis_group
("model")); on a group of one rank each is the identity. Collectives go
through dsrun.runtime.comm, so the comms logger counts their bytes.
"""
from __future__ import annotations

import torch

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import MeshGroup
from dsrun.runtime.parallel.tensor.random import enter_split_region, leave_split_region


def _check_divisible(size: int, parts: int, what: str) -> None:
    if size % parts:
        raise ValueError(f"tensor parallelism: {what} has size {size}, which the {parts} ranks of the "
                         f"model group cannot split evenly; make it a multiple of {parts}")


def _all_reduce(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, group=group.group)
    return out


def _slice(x: torch.Tensor, dim: int, group: MeshGroup) -> torch.Tensor:
    """This rank's contiguous slice of `x` along `dim` (a copy)."""
    _check_divisible(x.shape[dim], group.size, f"dimension {dim} of a tensor of shape {tuple(x.shape)}")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group: MeshGroup) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((group.size * front.shape[0],) + tuple(front.shape[1:]))
    comm.all_gather_into_tensor(out.view(-1), front.view(-1), group=group.group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: MeshGroup) -> torch.Tensor:
    """The sum of every rank's `x`, of which this rank keeps its slice along `dim`."""
    _check_divisible(x.shape[dim], group.size, f"dimension {dim} of a tensor of shape {tuple(x.shape)}")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // group.size,) + tuple(front.shape[1:]))
    comm.reduce_scatter_tensor(out.view(-1), front.view(-1), group=group.group)
    return out.movedim(0, dim).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _slice(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, -1, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, reduce_grads):
        ctx.group, ctx.dim, ctx.reduce_grads = group, dim, reduce_grads
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grads:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _slice(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_region(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """Megatron's f: `x` (any shape) unchanged; backward all-reduces (sums)
    its gradient over `group`. Put before a column-parallel layer whose
    input every rank holds whole."""
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """Megatron's g: the sum of every rank's `x` (any shape, same on every
    rank); backward passes the gradient through. Put after a row-parallel
    layer's partial products."""
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """This rank's slice of the last dimension of `x`: (..., n) -> (..., n/tp);
    backward all-gathers the gradient.

    Raises:
        ValueError: n is not a multiple of the group size.
    """
    return x if group.size == 1 else _ScatterToRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension, in rank order:
    (..., n/tp) -> (..., n); backward keeps this rank's slice of the gradient."""
    return x if group.size == 1 else _GatherFromRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: MeshGroup, dim: int = 0,
                                reduce_grads: bool = True) -> torch.Tensor:
    """Every rank's tokens concatenated along the sequence dimension `dim`:
    (s/tp, ...) -> (s, ...) for dim 0. Backward reduce-scatters the gradient
    along `dim` (the next layer is column-parallel, so each rank's gradient
    is a partial sum), or, with reduce_grads=False (the gathered tensor is
    used identically on every rank), keeps this rank's slice; the latter
    also leaves the sequence-parallel region's random state (random.py
    [Note: dropout in tensor-parallel regions])."""
    if not reduce_grads:
        leave_split_region()
    return x if group.size == 1 else _GatherFromSequenceRegion.apply(x, group, dim, reduce_grads)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: MeshGroup, dim: int = 0) -> torch.Tensor:
    """The sum of every rank's `x`, of which this rank keeps its tokens along
    `dim`: (s, ...) -> (s/tp, ...) for dim 0; backward all-gathers the gradient.

    Raises:
        ValueError: s is not a multiple of the group size.
    """
    return x if group.size == 1 else _ReduceScatterToSequenceRegion.apply(x, group, dim)


def scatter_to_sequence_region(x: torch.Tensor, group: MeshGroup, dim: int = 0) -> torch.Tensor:
    """This rank's tokens of `x` (the same on every rank) along `dim`:
    (s, ...) -> (s/tp, ...) for dim 0; backward all-gathers the gradient.
    Enters a sequence-parallel region from a replicated one (the embedding's
    output in Megatron's GPT), random draws included (random.py [Note:
    dropout in tensor-parallel regions]).

    Raises:
        ValueError: s is not a multiple of the group size.
    """
    if group.size == 1:
        return x
    out = _ScatterToSequenceRegion.apply(x, group, dim)
    enter_split_region()
    return out

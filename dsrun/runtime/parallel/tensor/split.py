"""Where a tensor-parallel parameter's slice sits in the full tensor.

[Note: the split a parameter carries]
Every parameter a tensor-parallel layer shards carries `param.tp_split`, a
`TensorSplit`: the shape of the full (logical) tensor as the unsharded
model stores it, and which of its elements this rank holds, in the order
the rank holds them. Three layouts need more than "chunk r of dimension d":

- a fused q/k/v weight (GPT-2's c_attn, the byte GPT's qkv): rank r holds
  its heads of each of the q, k and v blocks, three ranges of rows;
- grouped-query key/value heads fewer than tp: rank r holds one head,
  the same rows as the other ranks of its replica group;
- GPT-2's Conv1D stores its weight (in, out), the layer keeps (out, in):
  the split is of the transposed full tensor (`transposed`).

So a split is (full_shape, transposed, dim, ranges): take the full tensor,
transpose it when `transposed`, keep the rows `ranges` of dimension `dim`
in order, and the result is the parameter. `local_index` applies exactly
that to the element numbers of the full tensor, giving for each local
element its position in the full tensor's flattened (row-major) storage:
checkpoints (dsrun/runtime/checkpoint/tensor_split.py) use it to store the
full tensor and to read any rank's slice at any tensor-parallel size,
bit for bit, and the 16-bit export to reassemble the full tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSplit:
    """This rank's slice of a full tensor (see [Note: the split a parameter carries]).

    full_shape: the full tensor's shape, as the unsharded model stores it
        (GPT-2's Conv1D: (in, out)).
    dim: the dimension of the (transposed, for `transposed`) full tensor
        that is split.
    ranges: the [start, stop) ranges of `dim` this rank holds, in the
        order it holds them.
    transposed: the parameter is a slice of the full tensor's transpose (2-D).
    rank, size: this rank's tensor-parallel rank and the tensor-parallel size.
    """

    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]
    transposed: bool = False
    rank: int = 0
    size: int = 1

    @classmethod
    def chunk(cls, full_shape: tuple[int, ...], dim: int, rank: int, size: int,
              transposed: bool = False) -> TensorSplit:
        """Chunk `rank` of `size` equal chunks of dimension `dim` (of the
        transposed full tensor when `transposed`).

        Raises:
            ValueError: that dimension is not divisible by size.
        """
        shape = tuple(full_shape[::-1]) if transposed else tuple(full_shape)
        if shape[dim] % size:
            raise ValueError(f"TensorSplit: dimension {dim} of {shape} is not divisible by {size}")
        n = shape[dim] // size
        return cls(tuple(full_shape), dim, ((rank * n, (rank + 1) * n),), transposed, rank, size)

    def local_shape(self) -> tuple[int, ...]:
        """The shape of the parameter this split describes."""
        shape = list(self.full_shape[::-1] if self.transposed else self.full_shape)
        shape[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(shape)

    @property
    def whole(self) -> bool:
        """Whether the parameter is the full tensor itself (nothing split)."""
        return (not self.transposed and len(self.ranges) == 1
                and self.ranges[0] == (0, self.full_shape[self.dim]))

    def local_index(self) -> torch.Tensor:
        """int64 tensor of `local_shape()`, contiguous: for each element of
        the parameter, its index in the flattened full tensor."""
        numel = 1
        for d in self.full_shape:
            numel *= d
        index = torch.arange(numel, dtype=torch.int64).view(self.full_shape)
        if self.transposed:
            index = index.t()
        return torch.cat([index.narrow(self.dim, a, b - a) for a, b in self.ranges], dim=self.dim).contiguous()

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `full` (shape `full_shape`), contiguous."""
        return full.reshape(-1)[self.local_index().view(-1).to(full.device)].view(self.local_shape())


def split_of(param: torch.Tensor) -> TensorSplit | None:
    """The parameter's `tp_split` when it holds less than the full tensor
    (or another layout); None for a parameter every rank holds whole."""
    split = getattr(param, "tp_split", None)
    return None if split is None or split.whole else split

"""Memory-centric tiling: one huge linear layer as a grid of small ones.

[Note: tiled linear]
ZeRO-Infinity (Rajbhandari et al., SC21, section 5.1.3) runs an operator
larger than the memory for gathered parameters by splitting it into tiles
executed one after another. `TiledLinear(in_features, out_features,
in_splits=I, out_splits=O)` holds O x I `linear_cls` modules in nested
nn.ModuleLists; tile (o, i) maps input columns [in_parts[i], in_parts[i+1])
to output features [out_parts[o], out_parts[o+1]). Output part o is the sum
over i of its tiles' outputs (the bias lives in the last tile of each row),
and the parts are concatenated along the last dimension unless
combine_out_splits=False.

At stage 3 every element of an nn.ModuleList is a gather unit by default
(see [Note: units] in stage3.py), so each tile is a unit of its own: it is
gathered just before its forward runs and released after it, and the layer
never needs more than one tile gathered at a time (with
stage3_max_live_parameters set to about a tile, nothing else is kept
either). The arguments and the split rule (the first `n % parts` parts get
one more element) are DeepSpeed's `deepspeed.zero.TiledLinear`.
"""
from __future__ import annotations

import torch

from dsrun.runtime.zero.api import GatheredParameters
from dsrun.runtime.zero.params import record_of


def split_points(n: int, parts: int) -> list[int]:
    """Boundaries [0, ..., n] of `parts` near-equal consecutive ranges of n
    items; the first n % parts ranges get one extra item (n < parts: ranges
    of one item, then empty ones)."""
    if parts < 1:
        raise ValueError(f"number of splits must be >= 1, got {parts}")
    if n <= parts:
        return [min(p, n) for p in range(parts + 1)]
    size, extra = divmod(n, parts)
    return [p * size + min(p, extra) for p in range(parts + 1)]


class TiledLinear(torch.nn.Module):
    """A linear layer computed as `out_splits` x `in_splits` tiles (see [Note: tiled linear]).

    Args:
        in_features, out_features: sizes of the whole layer.
        bias: whether each output part has a bias (held by its last tile).
        in_splits, out_splits: tiles along the input and output features.
        input_is_already_split: forward receives a list of `in_splits`
            tensors (the input columns of each tile) instead of one tensor.
        combine_out_splits: concatenate the output parts (else forward
            returns the list of `out_splits` tensors).
        linear_cls: the tile class, called as linear_cls(in, out, bias=..., **kwargs).
        init_linear: a module with `weight` (out_features, in_features) and
            optional `bias` (out_features,) to copy the tiles' values from
            (gathered first when its parameters are partitioned).

    forward: input (..., in_features) -> (..., out_features), or lists as above.

    Raises:
        ValueError: a split count outside [1, features], or an input with
            the wrong number of parts.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls=torch.nn.Linear, init_linear: torch.nn.Module | None = None, **kwargs):
        super().__init__()
        if not 1 <= in_splits <= in_features or not 1 <= out_splits <= out_features:
            raise ValueError(f"TiledLinear: in_splits must be in [1, {in_features}] and out_splits in "
                             f"[1, {out_features}], got {in_splits} and {out_splits}")
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = split_points(in_features, in_splits)
        self.out_parts = split_points(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            row = torch.nn.ModuleList()
            for i in range(in_splits):
                row.append(linear_cls(self.in_parts[i + 1] - self.in_parts[i], self.out_parts[o + 1] - self.out_parts[o],
                                      bias=bias and i == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_):
        if self.in_splits > 1 and not self.input_is_already_split:
            inputs = torch.split(input_, [self.in_parts[i + 1] - self.in_parts[i] for i in range(self.in_splits)],
                                 dim=-1)
        elif self.in_splits > 1:
            inputs = input_
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: expected the input in {self.in_splits} parts, got {len(inputs)}")
        else:
            inputs = [input_]
        outputs = []
        for row in self.linears:
            out = None
            for tile, x in zip(row, inputs):
                y = tile(x)  # stage 3: this tile alone is gathered here
                out = y if out is None else out + y
            outputs.append(out)
        return torch.cat(outputs, dim=-1) if self.combine_out_splits else outputs

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy `other.weight` (out_features, in_features) and `other.bias`
        into the tiles. Works on stage-3 partitioned parameters on both sides
        (collective then: every rank must call it)."""
        params = [p for p in (other.weight, getattr(other, "bias", None)) if p is not None]
        with GatheredParameters(params, enabled=any(record_of(p) is not None for p in params)):
            for o, row in enumerate(self.linears):
                lo_out, hi_out = self.out_parts[o], self.out_parts[o + 1]
                for i, tile in enumerate(row):
                    lo_in, hi_in = self.in_parts[i], self.in_parts[i + 1]
                    mine = list(tile.parameters())
                    with GatheredParameters(mine, modifier_rank=0,
                                            enabled=any(record_of(p) is not None for p in mine)):
                        tile.weight.copy_(other.weight[lo_out:hi_out, lo_in:hi_in])
                        if tile.bias is not None and getattr(other, "bias", None) is not None:
                            tile.bias.copy_(other.bias[lo_out:hi_out])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"in_splits={self.in_splits}, out_splits={self.out_splits}")

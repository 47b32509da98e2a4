"""One flat set of parameters and the optimizer-side tensors a rank owns for it.

A `FlatParamSet` is a list of parameters laid out by a `FlatLayout` (stage
1/2: one set per optimizer param group; stage 3: one set per unit, bucketed
by optimizer group). On this rank it holds:

- the compute copy: the full flat buffer (stages 1-2; parameters are views
  into it) or only this rank's partition (stage 3; see stage3.py);
- the master copy the optimizer steps (fp32): its own tensor when the
  compute dtype is 16-bit, else the compute storage itself;
- `grad_partition`: this rank's shards of the averaged gradients, in the
  gradient accumulation dtype.

The optimizer sees one tensor per bucket (`master_views[b]`): a bucket never
mixes optimizer groups (`FlatLayout.build(keys=...)`), and in fp32 stages
1-2 a rank's shards are not contiguous in the full buffer, so one tensor per
group would need a copy.
"""
from __future__ import annotations

import torch

from dsrun.runtime.precision import PrecisionPolicy
from dsrun.runtime.zero.partition import FlatLayout, flatten_into, param_views, shard_of


class FlatParamSet:
    """Parameters `params` (with `names`, optimizer group per parameter in
    `groups`, grouped together) flattened over `world_size` ranks.

    partition_params: False keeps the full compute flat buffer on every rank
    (stages 1-2), True keeps only this rank's shards (stage 3).
    Raises ValueError when parameters of one group are not adjacent.
    """

    def __init__(self, name: str, params: list[torch.nn.Parameter], names: list[str],
                 groups: list[int], rank: int, world_size: int, precision: PrecisionPolicy,
                 bucket_numel: int | None, partition_params: bool):
        seen: list[int] = []
        for g in groups:
            if not seen or seen[-1] != g:
                if g in seen:
                    raise ValueError(f"{name}: parameters of optimizer group {g} are not adjacent")
                seen.append(g)
        self.name = name
        self.params = params
        self.rank = rank
        self.precision = precision
        self.layout = FlatLayout.build([(n, p.shape) for n, p in zip(names, params)], world_size,
                                       bucket_numel, keys=groups)
        self.group_of_bucket = [groups[self.layout.slots_of_bucket(b.index)[0].index]
                                for b in self.layout.buckets]
        device = params[0].device
        compute, master_dtype = precision.compute_dtype, precision.master_dtype
        # The fp32 values as given, before any cast: masters start exact.
        exact = flatten_into(self.layout, [p.detach() for p in params], master_dtype, device)
        own = _own_positions(self.layout, rank)
        if partition_params:
            self.full: torch.Tensor | None = None
            self.partition = torch.empty(self.layout.shard_numel, dtype=compute, device=device)
            for src, dst, w in own:
                self.partition[dst:dst + w].copy_(exact[src:src + w])
        else:
            self.full = exact if compute == master_dtype else exact.to(compute)
            self.partition = None
            for p, view in zip(params, param_views(self.layout, self.full)):
                p.data = view
        if precision.mixed:
            self.master = torch.empty(self.layout.shard_numel, dtype=master_dtype, device=device)
            for src, dst, w in own:
                self.master[dst:dst + w].copy_(exact[src:src + w])
            self.master_views = [shard_of(self.layout, self.master, b) for b in self.layout.buckets]
        elif partition_params:
            self.master = self.partition
            self.master_views = [shard_of(self.layout, self.partition, b) for b in self.layout.buckets]
        else:
            self.master = None  # the own shards of `full` are the master weights
            self.master_views = [self.full[src:src + w] for src, _, w in own]
        del exact
        self.grad_partition = torch.zeros(self.layout.shard_numel, dtype=precision.grad_accum_dtype,
                                          device=device)

    def grad_views(self) -> list[torch.Tensor]:
        """`grad_partition` cut like `master_views` (one per bucket)."""
        return [shard_of(self.layout, self.grad_partition, b) for b in self.layout.buckets]

    def write_back_master(self, target: torch.Tensor) -> None:
        """Copy the stepped master weights into the compute copy `target`
        (the full flat buffer for stages 1-2, the partition for stage 3),
        casting to the compute dtype. No-op when they are the same memory."""
        if self.master is None or self.master is target:
            return
        if target.numel() == self.layout.shard_numel:
            target.copy_(self.master)
            return
        for (src, dst, w) in _own_positions(self.layout, self.rank):
            target[src:src + w].copy_(self.master[dst:dst + w])

    def local_piece_tensor(self, source: torch.Tensor, slot_index: int) -> torch.Tensor:
        """A zero tensor shaped like parameter `slot_index` holding this rank's
        elements of it, read from a partition-shaped `source` (fp32 result).
        Summed over ranks it gives the full tensor."""
        slot = self.layout.slots[slot_index]
        out = torch.zeros(slot.numel, dtype=torch.float32, device=source.device)
        for piece in self.layout.local_pieces(self.rank):
            if piece.slot.index == slot_index:
                n = piece.hi - piece.lo
                out[piece.lo:piece.hi].copy_(source[piece.shard_offset:piece.shard_offset + n])
        return out.view(slot.shape)

    def master_partition(self) -> torch.Tensor:
        """The master weights as one partition-shaped tensor (a copy when fp32
        stages 1-2 keep them inside the full buffer)."""
        if self.master is not None:
            return self.master
        out = torch.empty(self.layout.shard_numel, dtype=self.full.dtype, device=self.full.device)
        for src, dst, w in _own_positions(self.layout, self.rank):
            out[dst:dst + w].copy_(self.full[src:src + w])
        return out


def _own_positions(layout: FlatLayout, rank: int) -> list[tuple[int, int, int]]:
    """(offset in the full flat buffer, offset in the partition, width) of
    rank's shard of every bucket."""
    out = []
    for b in layout.buckets:
        w = layout.bucket_shard_numel(b)
        out.append((b.offset + rank * w, layout.bucket_shard_offset(b), w))
    return out

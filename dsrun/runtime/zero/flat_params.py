"""One flat set of parameters and the tensors a rank holds for it.

A `FlatParamSet` is a list of parameters laid out by a `FlatLayout` over the
shard group (stages 0-2: one set per optimizer param group; stage 3: one set
per gather unit, one bucket per parameter). On this rank it holds:

- the compute copy: the full flat buffer `full` (stages 0-2; parameters are
  views into it) or only this rank's `partition` (stage 3; the unit gathers
  the rest, see unit.py);
- the fp32 master copy the optimizer steps: its own partition `master`
  when the compute dtype is 16-bit, else the compute storage itself (the
  partition at stage 3, the own shards of `full` at stages 1-2);
- the averaged gradients of this rank's shards, in the gradient
  accumulation dtype: `grad_partition` (stages 2-3, 16-bit stage 0), or, at
  stage 1, the rank's shards of `grad_full`, the full accumulation buffer
  that is reduced in place at the boundary (no second copy).

Trainable parameters come first, frozen ones (stage 3 partitions them too)
after them: masters and gradients cover the trainable prefix only.

[Note: int8 frozen shards]
ZeRO++'s zero_quantized_nontrainable_weights (stage 3, `frozen_block` > 0):
the frozen buckets' shards, the tail [trainable_shard_numel, shard_numel)
of the partition, are not kept in the compute dtype. `partition` holds the
trainable prefix only and `frozen_message` this rank's frozen shards as
one int8 message of dsrun/runtime/comm/quantized.py (`pack_message`:
int8 codes in blocks of `frozen_block` elements, then the fp32 scales'
bytes), about 1/4 of fp32's bytes (1/2 of bf16's). The values are
quantized once, from the compute-dtype values, when the set is built; the
unit all-gathers the message as it is (collectives.py, `message=`), so a
gather never quantizes them again. Reads of whole values (checkpoints,
full_fp32_param) see the decoded compute-dtype values. Writes (a
checkpoint load, GatheredParameters(modifier_rank=...)) go into a decoded
staging copy (`frozen_staging`) that `commit_frozen` quantizes again, only
if some value changed.

The optimizer sees one tensor per `Span` (`master_view(span)`): a run of
buckets of one optimizer group whose master, gradient and compute shards are
each contiguous. At stage 3 that is one span per (unit, group); at stages 0-2
one per bucket, because the own shards of consecutive buckets are not
adjacent in `full`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsrun.runtime.comm import quantized
from dsrun.runtime.optim.precision import PrecisionPolicy
from dsrun.runtime.zero.experts import ExpertSetGroups
from dsrun.runtime.zero.groups import RankGroup, ZeroGroups
from dsrun.runtime.zero.params import home_device, record_of
from dsrun.runtime.zero.partition import BucketSlot, FlatLayout


@dataclass(frozen=True)
class Span:
    """Buckets `buckets` of one optimizer group, this rank's shards of which
    are elements [lo, hi) of its partition."""

    group: int
    buckets: tuple[BucketSlot, ...]
    lo: int
    hi: int


class FlatParamSet:
    """Parameters flattened over the shard group (see the module docstring).

    Args:
        name: for messages ("group0", a unit's module name).
        members: (parameter, qualified name, optimizer group index or None
            for a frozen parameter), trainable ones first, each group's
            members adjacent.
        shard: the shard group (its size is the layout's world size).
        precision: dtypes of compute copy, master and gradients.
        bucket_numel: most elements per bucket (None: one bucket; 1: one
            bucket per parameter, which is what zero.Init shards match).
        partition_params: True keeps only this rank's compute shards (stage 3).
        grad_in_full: True accumulates gradients in a full buffer reduced in
            place (stage 1).
        master_device: where the fp32 master lives (None: with the
            parameters). Another device than the parameters' (optimizer
            offload to host memory) gives a separate master even in fp32.
        pin_memory: page-lock a master or partition kept in host memory
            for a model on an accelerator (CUDA present).
        partition_device: where the stage-3 compute partition lives (None:
            with the parameters; parameter offload puts it in host memory).
        grad_device: where `grad_partition` lives (None: with the
            parameters; optimizer offload on an accelerator puts it in host
            memory, always page-locked there, since gradients are copied into
            it during backward: see [Note: offload copies] in
            offload/transfer.py). Not used with grad_in_full.
        frozen_block: > 0 (stage 3 only) keeps the frozen shards as int8
            blocks of this many elements (see [Note: int8 frozen shards]).
        experts: for a set of Mixture-of-Experts parameters, the groups it
            is partitioned, reduced and averaged over instead of the
            strategy's (`shard` is then `experts.groups.shard`; see [Note:
            expert partitions] in experts.py); None for dense parameters.

    Raises:
        ValueError: frozen parameters before trainable ones, a group's
            parameters not adjacent, or frozen_block without partition_params.
    """

    def __init__(self, name: str, members: list[tuple[torch.nn.Parameter, str, int | None]],
                 shard: RankGroup, precision: PrecisionPolicy, bucket_numel: int | None,
                 partition_params: bool, grad_in_full: bool = False,
                 master_device: torch.device | None = None, pin_memory: bool = False,
                 partition_device: torch.device | None = None, frozen_block: int = 0,
                 grad_device: torch.device | None = None, experts: ExpertSetGroups | None = None):
        keys = [k for _, _, k in members]
        if None in keys and any(k is not None for k in keys[keys.index(None):]):
            raise ValueError(f"{name}: frozen parameters must come after trainable ones")
        seen: list[int | None] = []
        for k in keys:
            if not seen or seen[-1] != k:
                if k in seen:
                    raise ValueError(f"{name}: parameters of optimizer group {k} are not adjacent")
                seen.append(k)
        self.name = name
        self.experts = experts
        self.params = [p for p, _, _ in members]
        self.rank = shard.rank
        self.precision = precision
        self.layout = FlatLayout.build([(n, _full_shape(p)) for p, n, _ in members], shard.size,
                                       bucket_numel, keys=["frozen" if k is None else k for k in keys])
        self.key_of_bucket = [keys[self.layout.slots_of_bucket(b.index)[0].index] for b in self.layout.buckets]
        trainable = [b for b, k in zip(self.layout.buckets, self.key_of_bucket) if k is not None]
        self.trainable_numel = sum(b.padded_numel for b in trainable)  # full flat elements
        self.trainable_shard_numel = self.trainable_numel // self.layout.world_size
        self.spans = _spans(self.layout, trainable, self.key_of_bucket, merge=partition_params)
        if frozen_block and not partition_params:
            raise ValueError(f"{name}: int8 frozen shards need partitioned parameters (stage 3)")
        self.frozen_shard_numel = self.layout.shard_numel - self.trainable_shard_numel
        self.frozen_block = frozen_block if self.frozen_shard_numel else 0
        self.frozen_message: torch.Tensor | None = None  # int8, see [Note: int8 frozen shards]
        self.frozen_staging: torch.Tensor | None = None
        device = home_device(self.params[0])
        self.compute_device = torch.device(device)  # where gathered parameters, gradients and buckets live
        compute, accum = precision.compute_dtype, precision.grad_accum_dtype
        if partition_params:
            self.full = None
            where = torch.device(device if partition_device is None else partition_device)
            kept = self.trainable_shard_numel if self.frozen_block else self.layout.shard_numel
            self.partition = torch.zeros(kept, dtype=compute, device=where,
                                         pin_memory=_pin(pin_memory, where, self.compute_device))
            if self.frozen_block:  # filled by _load_initial_values, then quantized once
                self.frozen_staging = torch.zeros(self.frozen_shard_numel, dtype=compute, device=where)
        else:
            # Untouched pages cost nothing: they fill as parameters move in and
            # the originals are freed, so the model never exists twice.
            self.full = torch.empty(self.layout.padded_numel, dtype=compute, device=device)
            for b in self.layout.buckets:
                self.full[b.offset + b.numel:b.offset + b.padded_numel].zero_()  # padding stays zero
            self.partition = None
        master_device = torch.device(device if master_device is None else master_device)
        # A separate master: 16-bit compute, or fp32 compute on another device than the step's.
        self.separate_master = precision.mixed or master_device != torch.device(device)
        self.master = (torch.zeros(self.trainable_shard_numel, dtype=torch.float32, device=master_device,
                                   pin_memory=_pin(pin_memory, master_device, self.compute_device))
                       if self.separate_master else None)
        self._load_initial_values()
        if self.frozen_block:
            self.frozen_message = quantized.pack_message(self.frozen_staging, self.frozen_block)
            self.frozen_staging = None
        self.grad_full = self.grad_partition = None
        # True: gradients reach grad_partition through the offload copies (reducer.py, offload/transfer.py).
        self.grads_offloaded = False
        if grad_in_full:
            self.grad_full = torch.zeros(self.trainable_numel, dtype=accum, device=device)
        else:
            where = self.compute_device if grad_device is None else torch.device(grad_device)
            self.grad_partition = torch.zeros(self.trainable_shard_numel, dtype=accum, device=where,
                                              pin_memory=_pin(True, where, self.compute_device))
            self.grads_offloaded = where != self.compute_device

    def reduce_groups(self, default: ZeroGroups) -> ZeroGroups:
        """The (shard, replicate) pair this set's gradients are reduced and
        its parameters gathered over: its experts' pair, else `default`
        (the strategy's)."""
        return default if self.experts is None else self.experts.groups

    def average_over(self, default: ZeroGroups) -> int:
        """The number of ranks this set's gradient sums are averaged over
        (the data-parallel size D for experts, else `default`'s)."""
        return default.data_parallel_size if self.experts is None else self.experts.average_over

    def _load_initial_values(self) -> None:
        """Copy each parameter's value into the compute copy and the master,
        one parameter at a time, and point stage 0-2 parameters at `full`
        (their own storage is freed as it goes, so construction needs the
        model once plus the new buffers, not twice the model)."""
        spans_of = self.layout.shard_spans(self.rank)
        pieces: dict[int, list] = {}
        for piece in self.layout.local_pieces(self.rank):
            pieces.setdefault(piece.slot.index, []).append(piece)
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, self.params):
                bucket = self.layout.buckets[slot.bucket]
                _, dst, w = spans_of[slot.bucket]
                rec = record_of(p)
                init_shard = rec.init_shard if rec is not None else None
                if init_shard is not None:
                    # zero.Init shard == this rank's shard of the parameter's own bucket.
                    if bucket.numel != slot.numel or init_shard.numel() != w:
                        raise ValueError(f"{slot.name}: its zero.Init shard ({init_shard.numel()} elements) "
                                         f"does not match this layout (shard of {w}); build the model under "
                                         "zero.Init with the same data-parallel group")
                    self._store(slot, init_shard, dst)
                    continue
                flat = p.detach().reshape(-1)
                for piece in pieces.get(slot.index, ()):
                    self._store(slot, flat[piece.lo:piece.hi], piece.shard_offset)
                if self.full is not None:
                    view = self.full[slot.offset:slot.offset + slot.numel]
                    view.copy_(flat)
                    p.data = view.view(slot.shape)

    def _store(self, slot, values: torch.Tensor, dst: int) -> None:
        """Write `values` at partition offset `dst` into the master and
        (stage 3) the compute partition."""
        n = values.numel()
        if self.partition is not None:
            self.partition_piece(dst, n).copy_(values)
        if self.master is not None and self.key_of_bucket[slot.bucket] is not None:
            self.master[dst:dst + n].copy_(values)

    # ---- views the optimizer step uses ------------------------------------------
    def master_view(self, span: Span) -> torch.Tensor:
        """fp32 master shards of `span`, (hi - lo,), contiguous."""
        if self.master is not None:
            return self.master[span.lo:span.hi]
        if self.partition is not None:
            return self.partition[span.lo:span.hi]
        return self._own_of_full(self.full, span)

    def grad_view(self, span: Span) -> torch.Tensor:
        """Averaged gradient shards of `span`, (hi - lo,), accumulation dtype."""
        if self.grad_full is not None:
            return self._own_of_full(self.grad_full, span)
        return self.grad_partition[span.lo:span.hi]

    def copy_view(self, span: Span) -> torch.Tensor | None:
        """Where the compute copy of `span` lives, or None when the master
        is the compute storage itself (fp32 stepped where it lives)."""
        return self.compute_view(span) if self.separate_master else None

    def compute_view(self, span: Span) -> torch.Tensor:
        """This rank's compute-dtype shards of `span`, (hi - lo,)."""
        if self.partition is not None:
            return self.partition[span.lo:span.hi]
        return self._own_of_full(self.full, span)

    def _own_of_full(self, full: torch.Tensor, span: Span) -> torch.Tensor:
        (bucket,) = span.buckets  # spans of full buffers are single buckets
        src, _, w = self.layout.shard_spans(self.rank, [bucket])[0]
        return full[src:src + w]

    def grad_shards(self) -> list[torch.Tensor]:
        """The averaged gradient shards, one per span."""
        return [self.grad_view(s) for s in self.spans]

    def shard_of_slot(self, slot: int) -> torch.Tensor:
        """This rank's shard of slot's bucket in the compute copy (DeepSpeed's
        ds_tensor): int8 codes for an int8 frozen shard, as DeepSpeed's."""
        bucket = self.layout.buckets[self.layout.slots[slot].bucket]
        src, dst, w = self.layout.shard_spans(self.rank, [bucket])[0]
        if self.frozen_block and dst >= self.trainable_shard_numel:
            at = dst - self.trainable_shard_numel
            return self.frozen_message[at:at + w]
        if self.partition is not None:
            return self.partition[dst:dst + w]
        return self.full[src:src + w]

    # ---- the stage-3 compute partition, int8 frozen shards included ------------------
    def partition_piece(self, lo: int, n: int) -> torch.Tensor:
        """Elements [lo, lo + n) of this rank's compute partition, (n,),
        compute dtype, writable. Inside the int8 frozen shards it is a view
        of the decoded staging copy: writes reach the int8 shards at
        `commit_frozen()` (see [Note: int8 frozen shards])."""
        if not self.frozen_block or lo + n <= self.trainable_shard_numel:
            return self.partition[lo:lo + n]
        if lo < self.trainable_shard_numel:
            raise ValueError(f"{self.name}: elements [{lo}, {lo + n}) span trainable and frozen shards")
        at = lo - self.trainable_shard_numel
        return self.stage_frozen()[at:at + n]

    def frozen_values(self) -> torch.Tensor:
        """This rank's frozen shards, (shard_numel - trainable_shard_numel,),
        compute dtype: decoded from int8 (a new tensor) or the partition's tail."""
        if not self.frozen_block:
            return self.partition[self.trainable_shard_numel:]
        if self.frozen_staging is not None:
            return self.frozen_staging
        return quantized.unpack_message(self.frozen_message, self.frozen_shard_numel, self.frozen_block,
                                        self.partition.dtype)

    def stage_frozen(self) -> torch.Tensor:
        """The decoded staging copy of the int8 frozen shards (made on first use)."""
        if self.frozen_staging is None:
            self.frozen_staging = self.frozen_values()
        return self.frozen_staging

    def commit_frozen(self) -> None:
        """Quantize the staging copy into the int8 frozen shards if any value
        changed, and free it. No-op when nothing is staged."""
        staged, self.frozen_staging = self.frozen_staging, None
        if staged is not None and not torch.equal(staged, self.frozen_values()):
            self.frozen_message.copy_(quantized.pack_message(staged, self.frozen_block))  # in place: ds_tensor views it

    def write_back_master(self) -> None:
        """Copy the stepped master weights into the compute copy (casting).
        No-op when the master is the compute storage (fp32)."""
        for span in self.spans:
            target = self.copy_view(span)
            if target is not None:
                target.copy_(self.master_view(span))

    def zero_grad(self) -> None:
        """Zero the accumulated gradients."""
        (self.grad_full if self.grad_full is not None else self.grad_partition).zero_()

    # ---- reads of whole parameters ------------------------------------------------
    def local_piece_tensor(self, source: torch.Tensor, slot_index: int) -> torch.Tensor:
        """A zero fp32 tensor shaped like parameter `slot_index` holding this
        rank's elements of it, read from a partition-shaped `source`. Summed
        over the shard group it gives the full tensor."""
        slot = self.layout.slots[slot_index]
        out = torch.zeros(slot.numel, dtype=torch.float32, device=source.device)
        for piece in self.layout.local_pieces(self.rank):
            if piece.slot.index == slot_index:
                n = piece.hi - piece.lo
                out[piece.lo:piece.hi].copy_(source[piece.shard_offset:piece.shard_offset + n])
        return out.view(slot.shape)

    def partition_of(self, view) -> torch.Tensor:
        """`view(span)` of every span assembled into one partition-shaped
        tensor (shard_numel,), fp32 (a copy; zero outside the spans)."""
        out = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=home_device(self.params[0]))
        for span in self.spans:
            out[span.lo:span.hi].copy_(view(span))
        return out


def _pin(wanted: bool, where: torch.device, compute: torch.device) -> bool:
    """Page-lock a tensor in host memory `where` that serves an accelerator `compute`."""
    return wanted and where.type == "cpu" and compute.type != "cpu" and torch.cuda.is_available()


def _full_shape(p: torch.nn.Parameter) -> torch.Size:
    rec = record_of(p)
    return rec.shape if rec is not None else p.shape


def _spans(layout: FlatLayout, trainable: list[BucketSlot], key_of_bucket: list, merge: bool) -> list[Span]:
    spans: list[Span] = []
    for b in trainable:
        lo = layout.bucket_shard_offset(b)
        hi = lo + layout.bucket_shard_numel(b)
        key = key_of_bucket[b.index]
        if merge and spans and spans[-1].group == key and spans[-1].hi == lo:
            last = spans.pop()
            spans.append(Span(key, last.buckets + (b,), last.lo, hi))
        else:
            spans.append(Span(key, (b,), lo, hi))
    return spans

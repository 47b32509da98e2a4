"""Each sequence rank's slice of every batch: DeepSpeed's
`UlyssesSPDataLoaderAdapter` (deepspeed/runtime/sequence_parallel/
ulysses_sp.py) for Hugging Face-style dict batches, with lengths that P
does not divide padded and masked instead of refused.

[Note: what a sharded batch holds]
A batch is a dict of [b, N] tensors (input_ids, labels, position_ids,
attention_mask, ...) and other values. shard_batch

- shifts the labels as a causal LM's loss does (token t predicts t+1):
  `shift_labels[t] = labels[t+1]`, -100 for the last token. The shift must
  happen on the whole sequence: each rank's slice then ends with the label
  of the next rank's first token, which a model shifting its own slice
  would lose. `labels` is set to the same slice, so that a Hugging Face
  causal LM (whose loss uses `shift_labels` when given) computes its loss;
  a loss written by hand must use `shift_labels` and not shift again;
- adds `position_ids` (0..N-1) when absent: positions must be the tokens'
  places in the whole sequence (rotary and learned embeddings);
- pads N up to a multiple of P (input_ids and other tensors with 0,
  position_ids continuing N, N+1, ..., shift_labels with -100): attention
  is causal, so tokens appended at the end change no earlier token, and
  their labels do not count (DeepSpeed refuses such lengths: issue #7384);
- drops `attention_mask`: Ulysses attention is causal over the whole
  sequence and takes no mask (a [b, N] mask does not survive the
  all-to-all, a [b, 1, N, N] one is what long sequences cannot afford).
  Right padding (ones then zeros) is what causal attention plus -100 labels
  already handle; any other mask (left padding, holes) is refused;
- keeps rank r's tokens [r N'/P, (r+1) N'/P) of every tensor (N' padded).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from dsrun.runtime import comm

IGNORE_INDEX = -100


def _check_mask(mask: torch.Tensor) -> None:
    keep = mask.bool()
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError("shard_batch: the attention_mask has a 0 before a 1 (left padding or holes); Ulysses "
                         "attention is causal over the whole sequence and takes no mask, so only right padding "
                         "(with labels -100) is supported: pad on the right")


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_world_size: int) -> dict[str, Any]:
    """This sequence rank's slice of one batch (see [Note: what a sharded
    batch holds]).

    Args:
        batch: dict with `input_ids` [b, N] and `labels` [b, N] (int, -100
            for tokens that do not count); other tensors must be [b, N, ...]
            too; non-tensors are kept as they are.
        sp_rank, sp_world_size: this rank's place r in the P ranks of the
            sequence-parallel group.

    Returns:
        A new dict: every tensor [b, N'/P, ...] (N' = N rounded up to a
        multiple of P), with `shift_labels` and `position_ids` added, `labels`
        equal to `shift_labels`, no `attention_mask`.

    Raises:
        ValueError: no input_ids or labels; a tensor whose dimension 1 is not
            N; an attention_mask other than right padding.
    """
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise ValueError(f"shard_batch: the batch has no {key!r} (keys: {sorted(batch)}); a sequence-parallel "
                             "batch needs input_ids and labels (-100 where a token does not count)")
    length = batch["input_ids"].shape[1]
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != length):
            raise ValueError(f"shard_batch: {key} has shape {tuple(value.shape)} but input_ids "
                             f"{tuple(batch['input_ids'].shape)}; every tensor must be [batch, sequence, ...] "
                             "with input_ids' sequence length")
    out = dict(batch)
    mask = out.pop("attention_mask", None)
    if mask is not None:
        _check_mask(mask)
    labels = out.pop("labels")
    out["shift_labels"] = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(length, device=labels.device).expand(labels.shape[0], length)
    padded = -(-length // sp_world_size) * sp_world_size
    pad = padded - length
    for key, value in out.items():
        if not torch.is_tensor(value) or not pad:
            continue
        widths = (0, 0) * (value.dim() - 2) + (0, pad)
        if key == "shift_labels":
            out[key] = F.pad(value, widths, value=IGNORE_INDEX)
        elif key == "position_ids":
            out[key] = torch.cat([value, value[:, -1:] + torch.arange(1, pad + 1, device=value.device)], dim=1)
        else:
            out[key] = F.pad(value, widths, value=0)
    chunk = padded // sp_world_size
    for key, value in out.items():
        if torch.is_tensor(value):
            out[key] = value[:, sp_rank * chunk:(sp_rank + 1) * chunk].contiguous()
    out["labels"] = out["shift_labels"]
    return out


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's `UlyssesSPDataLoaderAdapter`: wraps a data loader of dict
    batches so that each rank of a sequence-parallel group gets its slice of
    every batch (shard_batch).

    Two ways the wrapped loader may hand out samples:

    - `shared_samples=False` (DeepSpeed's): each rank's loader yields its
      own batches (a sampler over all ranks, as a Hugging Face Trainer
      makes). Each time the ranks exchange one batch each (an all-gather of
      the batch objects) and then all P batches are processed in turn, each
      rank taking its slice: P micro-batches per batch of the wrapped
      loader, in rank order. Batches may have different lengths.
    - `shared_samples=True`: the ranks of a sequence group already read the
      same batches (dsrun's loader from initialize(training_data=...), which
      shards over the data axis only); each batch is sliced, no exchange.

    Args:
        dl: any iterable of dict batches (see shard_batch).
        sp_rank, sp_group, sp_world_size: the sequence-parallel group and
            this rank's place in it.
        device: where the slices are moved (None: left where they are).
        shared_samples: see above.

    Iterating gives dicts of [b, N'/P] tensors (shard_batch). len() is the
    number of micro-batches an epoch gives when `dl` has a length.
    """

    def __init__(self, dl: Iterable[Mapping[str, Any]], sp_rank: int, sp_group: ProcessGroup | None,
                 sp_world_size: int, device: torch.device | str | None = None,
                 shared_samples: bool = False) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.shared_samples = shared_samples

    def __len__(self) -> int:
        return len(self.dl) * (1 if self.shared_samples else self.sp_world_size)

    def _slice(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        out = shard_batch(batch, self.sp_rank, self.sp_world_size)
        if self.device is not None:
            out = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in out.items()}
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.dl:
            if self.shared_samples or self.sp_world_size == 1:
                yield self._slice(batch)
                continue
            cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
            for each in comm.all_gather_object(cpu, group=self.sp_group):
                yield self._slice(each)

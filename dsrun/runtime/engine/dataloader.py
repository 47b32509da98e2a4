"""Per-rank data loading: each rank reads its own shard in micro-batches.

[Note: shards and epochs]
A DistributedSampler splits the dataset into world_size disjoint shards
(shuffled with a seed shared by all ranks, so the shards are a partition of
the same permutation). Like DeepSpeed's loader, the sampler does not drop
samples: when the dataset size is not a multiple of world_size it repeats a
few samples so every rank gets the same number of samples -- and therefore
the same number of micro-batches, which keeps ranks in lock-step (a rank
with one batch more would wait forever in a collective). The last
micro-batch of an epoch may be smaller than the micro-batch size unless
drop_last is asked for. Each new iteration (epoch) reshuffles with
seed + epoch.

[Note: resuming mid-epoch]
The loader counts the micro-batches it has handed out in the current epoch;
`state_dict()` is {"epoch", "batches"} and is saved in checkpoints. After
`load_state_dict`, the next iteration replays that epoch's permutation
(same seed and epoch) without its first `batches` micro-batches: the
sampler skips their indices, so nothing is loaded twice. The position is
per-rank shard; beside it the state holds `samples`, the epoch's samples
all data ranks took (batches x micro-batch size x shards), which is a
prefix of the epoch's permutation whatever the layout (each shard is every
`shards`-th index of it, [Note: shards and epochs]). A loader with another
number of shards or another micro-batch size resumes from `samples` when it
is a whole number of its own global micro-batches, at exactly the next
sample; else load_state_dict says so (ValueError).

[Note: the loader leaves the global RNG alone]
torch's DataLoader draws a base seed (for its workers) from a generator
each time an iteration starts; without a generator of its own it draws from
the global torch RNG. A run resumed from a checkpoint starts its iteration
at another point than the uninterrupted run did (at the resume, not at the
epoch's start), so that draw would shift every later random number (dropout
masks) and the resumed run would no longer be bit for bit the uninterrupted
one. The loader therefore has its own generator, seeded with seed + epoch
at each iteration: the global RNG stream depends only on the training
itself, and the workers' seeds only on the epoch.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dsrun.runtime.distributed.dist import Topology


class _ResumableSampler(DistributedSampler):
    """DistributedSampler that can skip the first `skip` indices of the next
    epoch once (see [Note: resuming mid-epoch])."""

    skip = 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class DistributedDataLoader:
    """Iterates this rank's shard of `dataset` in micro-batches; reshuffles every epoch.

    Args:
        dataset: a map-style torch Dataset.
        micro_batch_size: samples per batch (train_micro_batch_size_per_gpu).
        topology: this rank's Topology (rank and world size pick the shard).
        collate_fn: merges samples into a batch (default: torch's).
        shuffle: shuffle the dataset each epoch (default True).
        seed: shuffle seed, identical on every rank.
        drop_last: drop the last, smaller micro-batch of each epoch.
        num_workers: DataLoader worker processes (0 = load in this process).

    Attributes:
        epoch: the epoch the next iteration will use.
    """

    def __init__(self, dataset: Dataset, micro_batch_size: int, topology: Topology,
                 collate_fn: Callable[[list], Any] | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, num_workers: int = 0) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.sampler = _ResumableSampler(dataset, num_replicas=topology.world_size,
                                          rank=topology.rank, shuffle=shuffle, seed=seed,
                                          drop_last=False)
        self._generator = torch.Generator()  # see [Note: the loader leaves the global RNG alone]
        self.loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 num_workers=num_workers, generator=self._generator,
                                 pin_memory=topology.device.type == "cuda")
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.drop_last = drop_last
        self.epoch = 0
        self._position = (0, 0)  # (epoch in progress, micro-batches handed out in it)

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank (equal on every rank)."""
        n, b = self.sampler.num_samples, self.micro_batch_size
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self.epoch, self.sampler.skip // self.micro_batch_size
        self.sampler.set_epoch(epoch)
        self._generator.manual_seed(self.seed + epoch)
        self.epoch += 1
        self._position = (epoch, skip)
        for i, batch in enumerate(self.loader, start=skip + 1):
            # Counted before the batch is handed out: a checkpoint taken while
            # it is being used resumes after it.
            self._position = (epoch, i)
            yield batch

    def state_dict(self) -> dict[str, int]:
        """{"epoch", "batches", "samples"}: the next micro-batch is batch
        `batches` (0-based) of epoch `epoch`; `samples` of the epoch are taken
        over all shards (JSON-able; see [Note: resuming mid-epoch])."""
        epoch, batches = self._position
        if batches >= len(self):
            epoch, batches = epoch + 1, 0
        return {"epoch": epoch, "batches": batches,
                "samples": batches * self.micro_batch_size * self.sampler.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Make the next iteration continue at `state` (see [Note: resuming
        mid-epoch]): at its `samples` when given (any number of shards and
        micro-batch size), else at its `batches` (this layout's own).

        Raises:
            ValueError: `samples` is not a whole number of this loader's
                global micro-batches (micro-batch size x shards).
        """
        batches = int(state["batches"])
        if "samples" in state:
            step = self.micro_batch_size * self.sampler.num_replicas
            if int(state["samples"]) % step:
                raise ValueError(f"the data loader cannot resume at sample {state['samples']} of its epoch: "
                                 f"not a multiple of micro-batch size {self.micro_batch_size} x "
                                 f"{self.sampler.num_replicas} data-parallel shards")
            batches = int(state["samples"]) // step
        self.epoch = int(state["epoch"])
        self.sampler.skip = batches * self.micro_batch_size
        self._position = (self.epoch, batches)


class RepeatingLoader:
    """Iterate `loader` forever: when it is exhausted, start a new pass
    (DeepSpeed's `RepeatingLoader`; a DistributedDataLoader reshuffles for
    its next epoch)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self._iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self):
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self.loader)
            return next(self._iter)

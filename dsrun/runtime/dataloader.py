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
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dsrun.runtime.dist import Topology


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
        self.sampler = DistributedSampler(dataset, num_replicas=topology.world_size,
                                          rank=topology.rank, shuffle=shuffle, seed=seed,
                                          drop_last=False)
        self.loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 num_workers=num_workers,
                                 pin_memory=topology.device.type == "cuda")
        self.epoch = 0

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank (equal on every rank)."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

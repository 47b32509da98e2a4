"""Ulysses sequence parallelism (Jacobs et al. 2023, arXiv 2309.14509):
DistributedAttention (attention.py) with its all-to-alls (all_to_all.py),
each rank's slice of a sample (data.py) and the token-averaged loss
(loss.py). The config key `sequence_parallel_size` builds the mesh's
sequence axis in initialize()."""
from dsrun.runtime.parallel.sequence.attention import DistributedAttention
from dsrun.runtime.parallel.sequence.data import shard_sequence
from dsrun.runtime.parallel.sequence.loss import sequence_parallel_loss

__all__ = ["DistributedAttention", "sequence_parallel_loss", "shard_sequence"]

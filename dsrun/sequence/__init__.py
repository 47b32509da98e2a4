"""DeepSpeed's `deepspeed.sequence`: Ulysses sequence parallelism
(dsrun/runtime/parallel/sequence/)."""
from dsrun.runtime.parallel.sequence import (
    DistributedAttention,
    sequence_parallel_loss,
    shard_sequence,
)

__all__ = ["DistributedAttention", "sequence_parallel_loss", "shard_sequence"]

"""DeepSpeed's `deepspeed.sequence.layer`: DistributedAttention."""
from dsrun.runtime.parallel.sequence.attention import DistributedAttention

__all__ = ["DistributedAttention"]

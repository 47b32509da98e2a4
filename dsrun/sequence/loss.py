"""The token-averaged loss under sequence parallelism (dsrun's; DeepSpeed
leaves it to the user, see DeepSpeed issue #5248)."""
from dsrun.runtime.parallel.sequence.loss import sequence_parallel_loss

__all__ = ["sequence_parallel_loss"]

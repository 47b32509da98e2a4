"""DeepSpeed's `deepspeed.runtime.sequence_parallel.ulysses_sp`: the data
loader adapter (each sequence rank's slice of every batch) and the
Hugging Face attention wrapper. DeepSpeed's `UlyssesSPAttentionHF.
register_with_transformers` is `wrap_hf_attention(model)` here: dsrun takes
the groups from its mesh (config sequence_parallel_size or
initialize(mesh_param=...)), not from a returned mpu."""
from dsrun.runtime.parallel.sequence.batches import UlyssesSPDataLoaderAdapter, shard_batch
from dsrun.runtime.parallel.sequence.hf import wrap_hf_attention

__all__ = ["UlyssesSPDataLoaderAdapter", "shard_batch", "wrap_hf_attention"]

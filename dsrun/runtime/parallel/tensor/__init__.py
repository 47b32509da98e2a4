"""Tensor parallelism on the mesh's model axis (Megatron-LM, Shoeybi et al.
2019; sequence parallelism, Korthikanti et al. 2022): the region mappings
(mappings.py), the column/row-parallel linear layers and the vocabulary-
parallel embedding (layers.py), and the vocabulary-parallel cross-entropy
(cross_entropy.py)."""
from dsrun.runtime.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from dsrun.runtime.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  VocabParallelEmbedding,
                                                  allreduce_sequence_parallel_grads, linear_init)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "allreduce_sequence_parallel_grads", "linear_init", "vocab_parallel_cross_entropy"]

"""DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`: Ulysses
sequence parallelism around any local attention (Jacobs et al. 2023,
"DeepSpeed Ulysses", arXiv 2309.14509, Section 3.1).

Each rank of the sequence-parallel group holds N/P tokens of a sample. The
wrapper moves q, k and v in one all-to-all to all N tokens of h/P heads
(see all_to_all.py's [Note: one all-to-all for q, k and v]), runs the
local attention on them (which sees ordinary, whole-sequence attention over
fewer heads) and moves the output back in one more all-to-all. Per layer
each link carries 4Nh/P elements per sample in forward (q, k, v and the
output) against Megatron-SP's 4Nh. When P does not divide h the ranks take
h // P or h // P + 1 heads (heads.py's [Note: heads the sequence-parallel
size does not divide]); grouped-query attention's key/value heads go to
the ranks whose query heads use them.

Head counts are read from the tensors on every call, so layers with
different head counts (or grouped-query attention) share no state.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import MeshGroup
from dsrun.runtime.parallel.sequence.all_to_all import gather_heads, scatter_heads


class DistributedAttention(torch.nn.Module):
    """Ulysses attention over a sequence-parallel group.

    Args:
        local_attention: a module or callable `local_attention(q, k, v,
            *args, **kwargs)` taking q [b, N, h_r, d] and k, v [b, N,
            h_kv', d] (or [N, b, ...] for batch_dim_idx=1) for the whole
            sequence N, and returning [b, N, h_r, d_v] (same layout); h_r
            is this rank's query heads (h/P, or h // P or one more when P
            does not divide h) and h_kv' divides h_r (query head i uses
            key/value head i // (h_r / h_kv'), as in grouped-query
            attention).
        sequence_process_group: the sequence-parallel group: a torch
            ProcessGroup (e.g. dsrun.utils.groups._get_sequence_parallel_group())
            or a MeshGroup (mesh.axis_group("sequence")).
        scatter_idx: the head dimension of q/k/v; must be 2 (DeepSpeed's
            default and only working value).
        gather_idx: accepted for DeepSpeed's signature (0 or 1); as in
            DeepSpeed's current layer the sequence dimension is taken from
            `batch_dim_idx` at each call.

    Raises:
        ValueError: scatter_idx is not 2 or gather_idx not 0 or 1.
    """

    def __init__(self, local_attention: Any, sequence_process_group: ProcessGroup | MeshGroup | None,
                 scatter_idx: int = 2, gather_idx: int = 0) -> None:
        super().__init__()
        if scatter_idx != 2:
            raise ValueError(f"DistributedAttention: scatter_idx={scatter_idx}; the heads must be dimension 2 "
                             "of q, k and v ([batch, sequence, heads, head_dim] or [sequence, batch, heads, "
                             "head_dim]), so scatter_idx must be 2")
        if gather_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: gather_idx={gather_idx}; the sequence is dimension 0 or 1")
        self.local_attn = local_attention
        self.spg = (sequence_process_group.group if isinstance(sequence_process_group, MeshGroup)
                    else sequence_process_group)
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int = 0,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        """Attention of this rank's tokens against the whole sequence.

        Args:
            query: [b, n, h, d] (batch_dim_idx 0) or [n, b, h, d] (1): this
                rank's n = N/P consecutive tokens (the rank-th slice; see
                shard_sequence), every query head.
            key, value: the same tokens, h_kv heads (h_kv divides h; any
                h_kv and P). One dtype for all three. Every rank of the
                group must hold the same n: the all-to-all's block sizes
                assume it, and torch does not check that the ranks agree
                (shard_sequence refuses a length N that P does not
                divide).
            batch_dim_idx: 0 or 1, the layout above.
            *args, **kwargs: passed to the local attention (e.g. a causal
                flag; a mask must be for the whole sequence).

        Returns:
            [b, n, h, d_v] (or [n, b, h, d_v]): this rank's tokens of the
            attention output.

        Raises:
            ValueError: more ranks P than query heads h (the message
                names both), key/value heads that do not divide the query
                heads, mismatched shapes or dtypes, a local attention
                output that is not 4-D.
        """
        world = comm.get_world_size(self.spg) if self.spg is not None else 1
        if world == 1:
            return self.local_attn(query, key, value, *args, **kwargs)
        q, k, v = scatter_heads(query, key, value, self.spg, world, batch_dim_idx)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return gather_heads(context, query.shape[2], self.spg, world, batch_dim_idx)

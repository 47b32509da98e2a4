"""DeepSpeed's Ulysses DistributedAttention on head counts the sequence-parallel
size does not divide: for each case, whether it runs and how far its output is
from whole attention, or the error it stops with (what docs/sequence.md quotes).

    DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= /work/dsvenv/bin/torchrun --nproc_per_node 4 \\
        --rdzv-backend c10d --rdzv-endpoint localhost:0 bench/sequence/deepspeed_uneven_heads.py
    (--nproc_per_node 8: the 12-head cases)

Needs DeepSpeed in a virtual environment of its own: `python3 -m venv
/work/dsvenv && /work/dsvenv/bin/pip install torch==2.13.0 && DS_BUILD_OPS=0
/work/dsvenv/bin/pip install deepspeed==0.19.8`.
The sequence group is the whole job; DeepSpeed reads the group and this rank's
place in it from `deepspeed.utils.groups.mpu`, which is set to say so. q, k, v
are [batch 2, 8 tokens, heads, head_dim 4], each rank holding its 8/P tokens
(batch_dim_idx 0); the local attention is causal sdpa with grouped-query
key/value heads repeated. Cases: 6 query heads with 6, 3 and 2 key/value heads
on 4 ranks; 12 with 12 and 4 on 8.
"""
from __future__ import annotations

import types

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from deepspeed.utils import groups

BATCH, TOKENS, HEAD_DIM = 2, 8, 4


def _sdpa(q, k, v, *args, **kwargs):
    """Causal attention on [b, s, h, d], key/value heads repeated to the query heads."""
    k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def _try(heads: int, kv_heads: int, rank: int, world: int) -> str:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, TOKENS, h, HEAD_DIM, generator=g) for h in (heads, kv_heads, kv_heads))
    n = TOKENS // world
    mine = [t[:, rank * n:(rank + 1) * n].clone().requires_grad_() for t in (q, k, v)]
    try:
        out = DistributedAttention(_sdpa, dist.group.WORLD)(*mine, 0)
        out.sum().backward()
    except Exception as e:  # the point: which error DeepSpeed stops with
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    error = (out - _sdpa(q, k, v)[:, rank * n:(rank + 1) * n]).abs().max().item()
    return f"ran; max |output - whole attention| = {error:.3g}"


def main() -> None:
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups.mpu = types.SimpleNamespace(get_sequence_parallel_rank=lambda: rank,
                                       get_sequence_parallel_group=lambda: dist.group.WORLD,
                                       get_sequence_parallel_world_size=lambda: world)
    for heads, kv_heads in {4: [(6, 6), (6, 3), (6, 2)], 8: [(12, 12), (12, 4)]}[world]:
        verdict = _try(heads, kv_heads, rank, world)
        if rank == 0:
            print(f"DeepSpeed {deepspeed.__version__}, {heads} query / {kv_heads} key/value heads on {world} "
                  f"ranks: {verdict}", flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()

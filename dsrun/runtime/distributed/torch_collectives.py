"""torch.distributed's tensor-to-tensor collectives under the names this torch prefers.

torch 2.13 renamed `all_gather_into_tensor` and `reduce_scatter_tensor` to
`all_gather_single` and `reduce_scatter_single` (same arguments) and warns
with a FutureWarning at every call of the old names; earlier releases have
only the old names. dsrun calls these two, so its users see no warning they
did not cause. (A leaf module: dsrun.runtime.distributed.nodes and comm/ both use it.)
"""
from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

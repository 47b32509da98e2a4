"""`deepspeed.moe.layer.MoE`: not implemented; constructing one raises."""
from __future__ import annotations

import torch

from dsrun.compat.missing import FeatureNotImplemented, message


class MoE(torch.nn.Module):
    """DeepSpeed's expert-parallel Mixture-of-Experts layer (not in this release).

    Raises:
        FeatureNotImplemented: always, naming the feature and what to use.
    """

    def __init__(self, *args, **kwargs):
        raise FeatureNotImplemented(message(
            "deepspeed.moe.layer.MoE", "the Mixture of Experts layer (expert parallelism)",
            "build the experts as ordinary modules and mark the block with dsrun.utils.set_z3_leaf_modules "
            "under ZeRO-3"))

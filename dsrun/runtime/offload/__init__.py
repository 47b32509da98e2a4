"""ZeRO-Offload and ZeRO-Infinity: optimizer states and parameters in host memory or on NVMe.

`build_optimizer_tier(cfg, topology)` turns `zero_optimization.offload_optimizer`
into the tier object a ZeRO strategy steps through (optimizer_tier.py);
`build_param_tier` does the same for stage 3's `offload_param`
(param_tier.py). Swap files: swap.py; their cleanup after a killed rank:
registry.py.
"""
from __future__ import annotations


def build_optimizer_tier(cfg, topology):
    """The OptimizerTier for `cfg.zero_optimization.offload_optimizer` on this rank."""
    from dsrun.runtime.offload.optimizer_tier import NvmeOptimizerTier, OptimizerTier

    zero = cfg.zero_optimization
    off = zero.offload_optimizer
    if off.device == "nvme":
        return NvmeOptimizerTier(off.nvme_path, topology.rank, off.buffer_count, int(zero.sub_group_size),
                                 off.pin_memory, cfg.aio, ratio=off.ratio)
    return OptimizerTier(host=off.device == "cpu", pin_memory=off.pin_memory, sub_group_size=int(zero.sub_group_size),
                         force_native=cfg.zero_force_ds_cpu_optimizer)


def build_param_tier(cfg, topology):
    """The ParamTier for `cfg.zero_optimization.offload_param` (stage 3) on this rank."""
    from dsrun.runtime.offload.param_tier import NvmeParamTier, ParamTier

    off = cfg.zero_optimization.offload_param
    if off.device == "nvme":
        return NvmeParamTier(off.nvme_path, topology.rank, off.buffer_count, cfg.aio)
    return ParamTier(host=off.device == "cpu", pin_memory=off.pin_memory)

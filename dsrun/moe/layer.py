"""`deepspeed.moe.layer`: the Mixture-of-Experts layer with expert
parallelism (dsrun/runtime/parallel/expert/layer.py)."""
from dsrun.runtime.parallel.expert.layer import MoE

__all__ = ["MoE"]

"""`deepspeed.moe.experts`: the experts one rank holds
(dsrun/runtime/parallel/expert/experts.py)."""
from dsrun.runtime.parallel.expert.experts import Experts

__all__ = ["Experts"]

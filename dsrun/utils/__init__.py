"""DeepSpeed's `deepspeed.utils` names: logging, RepeatingLoader, process
groups, ZeRO-3 leaf modules and the safe_get_full_* accessors; plus the
offline tool zero_to_fp32.
"""
from dsrun.runtime.engine.dataloader import RepeatingLoader
from dsrun.runtime.observability.logging import logger
from dsrun.runtime.zero.api import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from dsrun.runtime.zero.module_hints import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from dsrun.utils import groups
from dsrun.utils.logging import log_dist

__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "groups", "log_dist", "logger", "safe_get_full_fp32_param",
           "safe_get_full_grad", "safe_get_full_optimizer_state", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "z3_leaf_module"]

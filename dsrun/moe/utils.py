"""`deepspeed.moe.utils`: optimizer parameter groups for expert parameters.

A parameter is an expert (MoE) parameter when it has the attribute
`allreduce` set to False, DeepSpeed's convention (its expert layers set it;
dsrun has none, so on dsrun models every parameter is a plain one and the
groups come back as they were, with the expected keys).
"""
from __future__ import annotations

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter marked as an expert parameter (`param.allreduce is False`)."""
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size: int = 178956971) -> list[dict]:
    """Split optimizer parameter groups so that expert parameters sit in groups
    of their own: one per (original group, expert group name), with
    `"moe": True` and `"name"` set to the expert group name
    (`param.group_name`), each cut into pieces of at most `max_group_size`
    elements. Other parameters stay in their original group (`"moe": False`).

    Args:
        param_groups: a group dict, or a list/tuple of them (as for torch.optim).
        max_group_size: most elements per expert group.

    Returns:
        The list of groups: the original ones (without expert parameters),
        then the expert groups.
    """
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    plain_groups, expert_groups = [], []
    for index, group in enumerate(groups):
        params = list(group["params"])
        plain_groups.append({**group, "params": [p for p in params if not is_moe_param(p)], "moe": False})
        by_name: dict[str, list] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(getattr(p, "group_name", f"expert_group_{index}"), []).append(p)
        for name, members in by_name.items():
            chunk, size = [], 0
            for p in members:
                if chunk and size + p.numel() > max_group_size:
                    expert_groups.append({**group, "params": chunk, "moe": True, "name": name})
                    chunk, size = [], 0
                chunk.append(p)
                size += p.numel()
            expert_groups.append({**group, "params": chunk, "moe": True, "name": name})
    return plain_groups + expert_groups

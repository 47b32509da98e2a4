"""The experts one rank holds, and the all-to-all that carries tokens to them."""
from __future__ import annotations

import copy

import torch

from dsrun.runtime import comm


def mark_expert_params(module: torch.nn.Module, group_name: str, num_local_experts: int = 1) -> None:
    """Mark every parameter of `module` as an expert parameter, DeepSpeed's
    convention: `allreduce = False` (not averaged over the whole data axis)
    and `group_name` (the expert groups whose expert-data-parallel group
    averages it; see groups.py); `num_local_experts` (the experts per rank,
    which names.py turns local expert indices into global ids with)."""
    for param in module.parameters():
        param.allreduce = False
        param.group_name = group_name
        param.num_local_experts = num_local_experts


class Experts(torch.nn.Module):
    """`num_local_experts` independent copies of `expert` (deep copies, so
    equal at construction), each applied to its own slice of the tokens.

    Args:
        expert: a module mapping [..., M] to [..., M] (or a tuple whose
            first element is that).
        num_local_experts: the copies this rank holds.
        expert_group_name: the expert groups' name ("ep_size_<P>"), set on
            every parameter.
    """

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1,
                 expert_group_name: str = "ep_size_1") -> None:
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        mark_expert_params(self, expert_group_name, num_local_experts)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [G, L, C, M] (G source ranks, L = num_local_experts, C slots)
        -> the experts' outputs, same shape: expert i sees tokens[:, i]."""
        outputs = []
        for i, expert in enumerate(self.deepspeed_experts):
            out = expert(tokens[:, i])
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.stack(outputs, dim=1)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its own transpose as the backward (the
    gradient of block j sent to rank j comes back from rank j)."""

    @staticmethod
    def forward(ctx, group, tokens: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        tokens = tokens.contiguous()
        out = torch.empty_like(tokens)
        comm.all_to_all_single(out, tokens, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        comm.all_to_all_single(out, grad, group=ctx.group)
        return None, out


def all_to_all(tokens: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal blocks of `tokens` (dim 0 cut into the group's size,
    block j to rank j) over `group`, differentiably; collective over it.
    The identity for a group of one rank (no communication)."""
    if group is None or comm.get_world_size(group) == 1:
        return tokens
    return _AllToAll.apply(group, tokens)

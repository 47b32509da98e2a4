"""`deepspeed.moe.sharded_moe`: DeepSpeed's gating functions, gate and MoE
layer under DeepSpeed's names and signatures, for scripts that build the
pieces by hand (Megatron-DeepSpeed style: `TopKGate` + `Experts` +
`MOELayer`) or call the gating functions directly.

`TopKGate` and `MOELayer` are dsrun's own classes (the ones `MoE` builds,
dsrun/runtime/parallel/expert/gating.py and layer.py), which take
DeepSpeed's arguments; the gating functions are thin adapters over
gating.py's, with DeepSpeed's argument order: the same formulas and
outputs ([Note: the gating outputs] in gating.py). Differences from
DeepSpeed 0.19:

- the gating functions return the dense (l_aux, combine_weights,
  dispatch_mask, exp_counts) only (exp_counts on the logits' device, as
  DeepSpeed's; `TopKGate` returns it on the CPU, as `MoE` does); DeepSpeed's internal `sparse_routes`
  and Tutel paths are not offered (`MOELayer(use_tutel=True)` logs a
  warning and uses dsrun's dispatch, as DeepSpeed does without Tutel);
  the layer itself moves tokens by index, as DeepSpeed's does with
  `sparse_routes`, from `TopKGate.route` (runtime/parallel/expert/routes.py);
- `top2gating` does not add its Gumbel noise to the caller's `logits` in
  place;
- the expert-parallel group is the mesh's (runtime/parallel/expert/groups.py):
  `_set_ep_group` accepts that group only (DeepSpeed's
  `groups._get_expert_parallel_group(name)` returns it).
"""
from __future__ import annotations

import torch

from dsrun.runtime.parallel.expert import gating
from dsrun.runtime.parallel.expert.gating import GateOutput, TopKGate, gumbel_noise
from dsrun.runtime.parallel.expert.layer import MOELayer

__all__ = ["MOELayer", "TopKGate", "_capacity", "einsum", "gumbel_rsample", "multiplicative_jitter",
           "top1gating", "top2gating", "topkgating"]

einsum = torch.einsum  # DeepSpeed's `einsum(rule, a, b)` is torch.einsum unless its USE_EINSUM is turned off

gumbel_rsample = gumbel_noise  # (shape, device) -> standard Gumbel samples, fp32


def multiplicative_jitter(x: torch.Tensor, device: torch.device | None = None, epsilon: float = 1e-2) -> torch.Tensor:
    """`x` times noise uniform in [1 - epsilon, 1 + epsilon], drawn on x's
    device (`device` is DeepSpeed's argument, which must name that device;
    it is not read). epsilon 0 returns `x` itself."""
    return x if epsilon == 0 else gating.multiplicative_jitter(x, epsilon)


def _capacity(gates: torch.Tensor, capacity_factor, min_capacity) -> torch.Tensor:
    """Slots per expert for `gates` [S, E]: ceil(S / E x capacity_factor), at
    least min_capacity (numbers or 0-dim tensors), as a 0-dim int64 tensor."""
    num_tokens, num_experts = gates.shape
    return torch.tensor(gating.capacity(num_tokens, num_experts, float(capacity_factor), int(min_capacity)),
                        dtype=torch.int64)


def _on_device(out: GateOutput, logits: torch.Tensor) -> GateOutput:
    """exp_counts on the logits' device, where DeepSpeed returns it."""
    return out._replace(exp_counts=out.exp_counts.to(logits.device))


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group=None) -> GateOutput:
    """Top-1 (Switch) gating of `logits` [S, E] (fp32): gating.top1_gating
    with DeepSpeed's argument order. Returns (l_aux, combine_weights
    [S, E, C], dispatch_mask [S, E, C] bool, exp_counts [E] int64 on the
    logits' device). Raises ValueError as gating.top1_gating."""
    return _on_device(gating.top1_gating(logits, capacity_factor, min_capacity, noisy_gate_policy=noisy_gate_policy,
                                         drop_tokens=drop_tokens, use_rts=use_rts, ep_group=ep_group,
                                         used_token=used_token), logits)


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, top2_2nd_expert_sampling: bool = True) -> GateOutput:
    """Top-2 (GShard) gating of `logits` [S, E] (fp32), E >= 2:
    gating.top2_gating with DeepSpeed's argument order; outputs as top1gating."""
    return _on_device(gating.top2_gating(logits, capacity_factor, min_capacity, drop_tokens=drop_tokens,
                                         ep_group=ep_group, second_expert_sampling=top2_2nd_expert_sampling),
                      logits)


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, drop_policy: str = "probs") -> GateOutput:
    """Top-k gating of `logits` [S, E] (fp32), k <= E: gating.topk_gating
    with DeepSpeed's argument order; outputs as top1gating. Raises
    ValueError for a drop_policy other than "probs" or "position"."""
    return _on_device(gating.topk_gating(logits, k, capacity_factor, min_capacity, drop_tokens=drop_tokens,
                                         ep_group=ep_group, drop_policy=drop_policy), logits)

"""`deepspeed.moe.sharded_moe`: DeepSpeed's gating functions, gate and MoE
layer under DeepSpeed's names and signatures, for scripts that build the
pieces by hand (Megatron-DeepSpeed style: `TopKGate` + `Experts` +
`MOELayer`) or call the gating functions directly.

Everything here is a thin adapter over dsrun's one implementation
(dsrun/runtime/parallel/expert/gating.py and layer.py): the same formulas,
the same outputs ([Note: the gating outputs] in gating.py), with
DeepSpeed's argument order and defaults. Differences from DeepSpeed 0.19:

- the gating functions return the dense (l_aux, combine_weights,
  dispatch_mask, exp_counts) only; DeepSpeed's internal `sparse_routes`
  and Tutel paths are not offered (`MOELayer(use_tutel=True)` logs a
  warning and uses dsrun's dispatch, as DeepSpeed does without Tutel);
- `top2gating` does not add its Gumbel noise to the caller's `logits` in
  place;
- the expert-parallel group is the mesh's (runtime/parallel/expert/groups.py):
  `_set_ep_group` accepts that group only (DeepSpeed's
  `groups._get_expert_parallel_group(name)` returns it).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from dsrun.runtime.parallel.expert import gating, layer
from dsrun.runtime.parallel.expert.gating import GateOutput, gumbel_noise
from dsrun.runtime.parallel.expert.groups import group_name

log = logging.getLogger("dsrun.moe")

__all__ = ["TopKGate", "MOELayer", "top1gating", "top2gating", "topkgating", "multiplicative_jitter",
           "gumbel_rsample", "einsum", "_capacity"]

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


class TopKGate(gating.TopKGate):
    """DeepSpeed's `TopKGate(model_dim, num_experts, k=1, capacity_factor=1.0,
    eval_capacity_factor=1.0, min_capacity=8, noisy_gate_policy=None,
    drop_tokens=True, use_rts=True, ep_group=None, top2_2nd_expert_sampling=True)`:
    dsrun's gate (gating.TopKGate) with DeepSpeed's argument order and
    defaults. `gate(tokens [S, M])` returns (l_aux, combine_weights,
    dispatch_mask, exp_counts) as top1gating. `ep_group` (needed with
    drop_tokens=False on several expert ranks) may be set later with
    `_set_ep_group`, as DeepSpeed's MOELayer does. Raises ValueError as
    gating.TopKGate.
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__(model_dim, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                         noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.ep_group = ep_group

    def _set_ep_group(self, ep_group) -> None:
        """Set the expert-parallel group once (DeepSpeed's MOELayer calls it).
        Raises ValueError when one is set already."""
        if self.ep_group is not None:
            raise ValueError("TopKGate: the expert-parallel group is set already; set it once")
        self.ep_group = ep_group

    def forward(self, tokens: torch.Tensor, used_token: torch.Tensor | None = None, ep_group=None) -> GateOutput:
        """Gate `tokens` [S, M]; `ep_group` (dsrun's MOELayer passes the
        mesh's) else the one set at construction or by `_set_ep_group`."""
        out = super().forward(tokens, used_token, ep_group=self.ep_group if ep_group is None else ep_group)
        return _on_device(out, tokens)


class MOELayer(layer.MOELayer):
    """DeepSpeed's `MOELayer(gate, experts, ep_group_name, ep_size,
    num_local_experts, use_tutel=False)`: dsrun's layer (layer.MOELayer;
    [Note: one MoE forward] there) with DeepSpeed's arguments.

    `gate` is a TopKGate (this module's or dsrun's), `experts` a
    `deepspeed.moe.experts.Experts` of `num_local_experts` experts named
    `ep_group_name`. `layer(x [..., M], used_token=None)` returns the
    output [..., M]; `layer.l_aux` and `layer.exp_counts` hold the gate's
    loss and counts afterwards. The expert groups are the mesh's
    (collective the first time an ep_size is used, see groups.py).

    Raises:
        ValueError: ep_group_name is not "ep_size_<ep_size>" (the name every
            expert parameter carries), or ep_size x num_local_experts is
            not the gate's number of experts.
    """

    def __init__(self, gate: gating.TopKGate, experts: torch.nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        if ep_group_name != group_name(ep_size):
            raise ValueError(f"MOELayer: ep_group_name={ep_group_name!r} must be {group_name(ep_size)!r} for "
                             f"ep_size={ep_size} (the name dsrun's expert groups and parameters carry)")
        num_experts = gate.wg.weight.shape[0]
        if ep_size * num_local_experts != num_experts:
            raise ValueError(f"MOELayer: ep_size={ep_size} x num_local_experts={num_local_experts} must equal "
                             f"the gate's num_experts={num_experts}")
        super().__init__(gate, experts, ep_size, num_local_experts)
        self.ep_group_name = ep_group_name
        self.ep_group = None
        if use_tutel:
            log.warning("MOELayer: use_tutel=True, but dsrun does not use Tutel; dispatching with its own "
                        "all-to-all (as DeepSpeed does when Tutel is not installed)")

    def _set_ep_group(self, ep_group) -> None:
        """Record the expert-parallel group DeepSpeed's engine would hand the
        layer (and its gate, if it takes one).

        Raises:
            ValueError: `ep_group` holds other ranks than this rank's
                expert-parallel group on dsrun's mesh (pass
                `deepspeed.utils.groups._get_expert_parallel_group(ep_group_name)`).
        """
        mine = self.groups().expert_parallel.ranks
        given = tuple(dist.get_process_group_ranks(ep_group)) if ep_group is not None else mine
        if given != mine:
            raise ValueError(f"MOELayer._set_ep_group: the group holds ranks {list(given)}, but this rank's "
                             f"expert-parallel group for ep_size={self.ep_size} is {list(mine)}; dsrun lays "
                             "expert groups out on its mesh: pass "
                             f"groups._get_expert_parallel_group({self.ep_group_name!r})")
        self.ep_group = ep_group
        if hasattr(self.gate, "_set_ep_group"):
            self.gate._set_ep_group(ep_group)

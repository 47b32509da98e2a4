"""Token-choice gating for Mixture of Experts: top-1 (Switch), top-2
(GShard) and top-k, with expert capacity and the load-balancing loss.

[Note: the gating outputs]
For S tokens and E experts a gate returns, in fp32:

- combine_weights [S, E, C]: the weight of token s in expert e's output at
  capacity slot c (zero where s is not in that slot);
- dispatch_mask [S, E, C] (bool): combine_weights != 0, the token-to-slot
  assignment;
- l_aux (scalar): the auxiliary load-balancing loss;
- exp_counts [E] (int64, CPU): how many tokens chose each expert before any
  was dropped (with k > 1 each choice counts).

The MoE layer takes the same decisions in another form, as routes
(`TopKGate.route`, the `*_routes` functions; see [Note: routes, not
[S, E, C] masks] in routes.py); the dense form above is built from them.

C, the capacity, is ceil(S / E x capacity_factor x k), at least
`min_capacity`; a token whose choice of expert finds the expert full is
dropped for that choice (its output there is zero; the layer's residual
connection, if any, carries it). With drop_tokens=False the capacity is the
largest number of tokens any expert got on any rank of the expert-parallel
group (an all-reduce MAX over it), so no token is dropped and every rank
still exchanges blocks of one size.

Which tokens keep their place when an expert is full (as DeepSpeed's
deepspeed/moe/sharded_moe.py selects them, so the same batch drops the same
tokens):
- top-1: the `capacity` rows that `torch.topk(score, capacity, dim=0)`
  returns for the expert's column, where score is the 0/1 choice mask times
  uniform noise with use_rts (Random Token Selection, DeepSpeed-MoE: a
  uniformly random subset of the tokens that chose it), and the bare 0/1
  mask without it. Without use_rts every chosen token ties at 1, so which
  of them stay is torch.topk's order on ties: an implementation detail of
  the device's kernel, NOT the first in token order (on CPU it is often a
  later run of tokens). See [Note: kept tokens follow torch.topk];
- top-2: first choices before second choices, each in token order (GShard,
  Lepikhin et al. 2020, Algorithm 1; DeepSpeed's top2gating too);
- top-k (k > 2): drop_policy "probs" keeps the `capacity` rows of
  `torch.topk(..., sorted=False)` over the gate probabilities of the
  tokens that chose the expert (zero elsewhere): the most probable ones,
  ties in torch.topk's order; "position" keeps the first in token order.
Kept tokens take their slots in token order either way.

[Note: kept tokens follow torch.topk]
A rule of our own ("the first tokens in token order", say) drops other
tokens than DeepSpeed's torch.topk once an expert overflows, and a
DeepSpeed client's losses then drift from the first over-capacity step on
(2% after 8 steps on the CIFAR MoE client). So the selection calls
torch.topk on exactly DeepSpeed's scores, with its arguments; the kept set
is then the same on the same device and torch version.

The load-balancing loss is E x sum_e(me_e x ce_e) with me_e the mean gate
probability of expert e over the tokens and ce_e the fraction of tokens
whose first choice is e (Switch Transformer, Fedus et al. 2021, eq. 4-6;
GShard); for k > 2 ce counts every choice and the loss is divided by k.
"""
from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from dsrun.runtime import comm
from dsrun.runtime.parallel.expert.routes import GateOutput, Routes, pick  # noqa: F401 - GateOutput re-exported

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: ceil(num_tokens / num_experts x capacity_factor), at least min_capacity."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor), min_capacity)


def gumbel_noise(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Standard Gumbel samples (fp32) of `shape`: -log(-log(U)), U ~ Uniform(0, 1)."""
    u = torch.rand(shape, device=device).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """`x` times noise uniform in [1 - epsilon, 1 + epsilon] (Switch
    Transformer's input jitter; DeepSpeed's "Jitter" policy)."""
    return x * torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)


def _dropless_capacity(counts: torch.Tensor, ep_group) -> int:
    """The largest per-expert token count (`counts` [E], on the tokens'
    device) over the expert-parallel group (an all-reduce MAX, collective
    over `ep_group` when it has > 1 rank)."""
    most = counts.max().reshape(1).to(torch.int64)
    if ep_group is not None and comm.get_world_size(ep_group) > 1:
        comm.all_reduce(most, op=comm.ReduceOp.MAX, group=ep_group)
    return max(int(most.item()), 1)


def _top_rows(score: torch.Tensor, cap: int, sorted: bool = True) -> torch.Tensor:
    """A 0/1 int64 mask [S, E] of the min(cap, S) rows `torch.topk` picks in
    each column of `score` [S, E] (ties in torch.topk's order)."""
    rows = score.topk(min(cap, score.shape[0]), dim=0, sorted=sorted).indices
    return torch.zeros(score.shape, dtype=torch.int64, device=score.device).scatter_(0, rows, 1)


def _routes(l_aux: torch.Tensor, picked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], cap: int,
            num_experts: int, counts: torch.Tensor) -> Routes:
    """Routes from one `pick` per choice (routes.py), choices in order."""
    experts, slots, weights = (torch.stack(part) for part in zip(*picked))
    return Routes(l_aux, experts, slots, weights, cap, num_experts, counts.cpu())


def top1_routes(logits: torch.Tensor, capacity_factor: float, min_capacity: int, *,
                noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
                ep_group=None, used_token: torch.Tensor | None = None) -> Routes:
    """Top-1 (Switch) gating over `logits` [S, E] (fp32), as routes (k = 1;
    routes.py); top1_gating gives the dense form, [Note: the gating outputs].

    noisy_gate_policy "RSample" picks each token's expert on logits plus
    Gumbel noise (the gate weight stays the noiseless probability).
    used_token [S] (0/1), when given, masks tokens out of routing.

    Raises:
        ValueError: fewer tokens than min_capacity with drop_tokens (too
            few tokens per batch to fill the minimum capacity).
    """
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    chooser = logits + gumbel_noise(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    choice = chooser.argmax(dim=1)
    mask = F.one_hot(choice, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    counts = mask.sum(dim=0).detach()
    l_aux = (gates.mean(dim=0) * mask.float().mean(dim=0)).sum() * num_experts
    if drop_tokens:
        if num_tokens < min_capacity:
            raise ValueError(f"MoE gate: {num_tokens} tokens is fewer than min_capacity={min_capacity}; "
                             "feed more tokens per batch or lower min_capacity")
        cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
        # See [Note: kept tokens follow torch.topk]; noise in [0, 1) keeps
        # the unchosen (score 0) below every chosen token.
        score = mask * torch.rand(mask.shape, device=mask.device) if use_rts else mask
        mask = mask * _top_rows(score, cap)
    else:
        cap = _dropless_capacity(counts, ep_group)
    locations = mask.cumsum(dim=0) - 1
    choice = choice.unsqueeze(1)
    return _routes(l_aux, [pick(choice[:, 0], mask, locations, gates.gather(1, choice).squeeze(1))], cap,
                   num_experts, counts)


def top1_gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, **options) -> GateOutput:
    """top1_routes (same arguments and errors) in the dense [S, E, C] form
    of [Note: the gating outputs]."""
    return top1_routes(logits, capacity_factor, min_capacity, **options).dense()


def top2_routes(logits: torch.Tensor, capacity_factor: float, min_capacity: int, *,
                drop_tokens: bool = True, ep_group=None, second_expert_sampling: bool = True) -> Routes:
    """Top-2 (GShard) gating over `logits` [S, E] (fp32), E >= 2, as routes
    (first choices, then second ones; routes.py); top2_gating gives the
    dense form, [Note: the gating outputs]. The second expert is the best other than the
    first on logits plus Gumbel noise when `second_expert_sampling`
    (DeepSpeed's top2_2nd_expert_sampling), else on the logits. A token's
    gate weights are renormalised to sum to 1 over the choices that kept a
    place (a token that lost one puts weight 1 on the other)."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    choice1 = gates.argmax(dim=1)
    mask1 = F.one_hot(choice1, num_classes=num_experts)
    noisy = logits + gumbel_noise(logits.shape, logits.device) if second_expert_sampling else logits
    choice2 = noisy.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1)
    mask2 = F.one_hot(choice2, num_classes=num_experts)
    locations1 = mask1.cumsum(dim=0) - 1
    locations2 = mask2.cumsum(dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    counts = (mask1 + mask2).sum(dim=0).detach()
    l_aux = (gates.mean(dim=0) * mask1.float().mean(dim=0)).sum() * num_experts
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (locations1 < cap)
        mask2 = mask2 * (locations2 < cap)
    else:
        cap = _dropless_capacity(counts, ep_group)
    gate1 = (gates * mask1).sum(dim=1, keepdim=True)
    gate2 = (gates * mask2).sum(dim=1, keepdim=True)
    denom = (gate1 + gate2).clamp(min=torch.finfo(gates.dtype).eps)
    return _routes(l_aux, [pick(choice1, mask1, locations1, (gate1 / denom).squeeze(1)),
                           pick(choice2, mask2, locations2, (gate2 / denom).squeeze(1))], cap, num_experts, counts)


def top2_gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, **options) -> GateOutput:
    """top2_routes (same arguments) in the dense [S, E, C] form of [Note:
    the gating outputs]."""
    return top2_routes(logits, capacity_factor, min_capacity, **options).dense()


DROP_POLICIES = ("probs", "position")


def topk_routes(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, *,
                drop_tokens: bool = True, ep_group=None, drop_policy: str = "probs") -> Routes:
    """Top-k gating over `logits` [S, E] (fp32), k <= E, as routes (a
    token's choices from the most probable down; routes.py); topk_gating
    gives the dense form, [Note: the gating outputs]. Each token goes to its k most probable experts, with
    its kept probabilities renormalised to sum to 1; a full expert keeps the
    tokens most probable for it (drop_policy "probs"), or the first in token
    order ("position", GShard's policy).

    Raises:
        ValueError: a drop_policy other than "probs" or "position".
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"MoE gate: drop_policy={drop_policy!r}; choose one of {DROP_POLICIES}")
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    choices = gates.topk(k, dim=1).indices
    mask = torch.zeros_like(gates, dtype=torch.int64).scatter_(1, choices, 1)
    counts = mask.sum(dim=0).detach()
    l_aux = (gates.mean(dim=0) * mask.float().mean(dim=0)).sum() * num_experts / k
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":  # see [Note: kept tokens follow torch.topk]
            mask = mask * _top_rows(gates.detach() * mask, cap, sorted=False)
        else:
            mask = mask * ((mask.cumsum(dim=0) - 1) < cap)
    else:
        cap = _dropless_capacity(counts, ep_group)
    locations = mask.cumsum(dim=0) - 1
    kept_gates = gates * mask
    weights = kept_gates / kept_gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
    return _routes(l_aux, [pick(choice, mask, locations, weights.gather(1, choice.unsqueeze(1)).squeeze(1))
                           for choice in choices.unbind(1)], cap, num_experts, counts)


def topk_gating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int,
                **options) -> GateOutput:
    """topk_routes (same arguments and errors) in the dense [S, E, C] form
    of [Note: the gating outputs]."""
    return topk_routes(logits, k, capacity_factor, min_capacity, **options).dense()


class TopKGate(torch.nn.Module):
    """The router: a bias-free fp32 linear map from the model dimension to
    E logits, then top-k gating (top1_gating, top2_gating, topk_gating).
    DeepSpeed's `deepspeed.moe.sharded_moe.TopKGate`, with its argument
    order and defaults.

    Args:
        model_dim: the hidden size M.
        num_experts: E.
        k: experts per token (1 <= k <= E).
        capacity_factor / eval_capacity_factor: in training / eval mode.
        min_capacity: fewest slots per expert.
        noisy_gate_policy: None, "Jitter" (multiplicative noise on the
            router's input) or "RSample" (Gumbel noise on the top-1 choice);
            training only.
        drop_tokens, use_rts: see [Note: the gating outputs].
        ep_group: the expert-parallel process group the dropless capacity
            is agreed over (or set later with `_set_ep_group`; the MoE
            layer passes its own to `forward`).
        top2_2nd_expert_sampling: top-2's Gumbel-noised second choice.

    Raises:
        ValueError: k outside [1, E], or an unknown noisy_gate_policy
            ("RSample" acts on top-1 gating only, as DeepSpeed's).
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8,
                 noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
                 ep_group=None, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"MoE gate: k={k} must be between 1 and num_experts={num_experts}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"MoE gate: noisy_gate_policy={noisy_gate_policy!r}; choose one of "
                             f"{NOISY_GATE_POLICIES}")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.ep_group = ep_group
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group) -> None:
        """Set the expert-parallel group once (DeepSpeed's MOELayer calls it).

        Raises:
            ValueError: a group is set already.
        """
        if self.ep_group is not None:
            raise ValueError("TopKGate: the expert-parallel group is set already; set it once")
        self.ep_group = ep_group

    def forward(self, tokens: torch.Tensor, used_token: torch.Tensor | None = None,
                ep_group=None) -> GateOutput:
        """Gate `tokens` [S, M] (any float dtype; routed in fp32); returns
        (l_aux, combine_weights, dispatch_mask, exp_counts), see [Note: the
        gating outputs]: `route`'s decisions in the dense form."""
        return self.route(tokens, used_token, ep_group).dense()

    def route(self, tokens: torch.Tensor, used_token: torch.Tensor | None = None, ep_group=None) -> Routes:
        """Gate `tokens` [S, M] (any float dtype; routed in fp32) as routes
        (routes.py; what MOELayer dispatches by). The dropless capacity
        (drop_tokens=False) is agreed over `ep_group`, else the group set
        at construction or by `_set_ep_group`."""
        ep_group = self.ep_group if ep_group is None else ep_group
        x = tokens.float()
        policy = self.noisy_gate_policy if self.training else None
        if policy == "Jitter":
            x = multiplicative_jitter(x)
        with torch.autocast(device_type=x.device.type, enabled=False):  # routing stays fp32 under autocast
            logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1_routes(logits, factor, self.min_capacity, noisy_gate_policy=policy,
                               drop_tokens=self.drop_tokens, use_rts=self.use_rts, ep_group=ep_group,
                               used_token=used_token)
        if self.k == 2:
            return top2_routes(logits, factor, self.min_capacity, drop_tokens=self.drop_tokens,
                               ep_group=ep_group, second_expert_sampling=self.top2_2nd_expert_sampling)
        return topk_routes(logits, self.k, factor, self.min_capacity, drop_tokens=self.drop_tokens,
                           ep_group=ep_group)

"""A gate's decisions as routes (token, choice) -> (expert, slot, weight),
and the dispatch and combine that move tokens by them.

[Note: routes, not [S, E, C] masks]
GShard writes the dispatch and the combine as einsums over a dense
[S, E, C] mask (S tokens, E experts, C slots each), and the gating
functions still return that form ([Note: the gating outputs] in
gating.py). The MoE layer does not use it: each of the two einsums is a
[E*C, S] x [S, M] matrix product, and with C = S/E that is S^2 x M
multiply-adds to move S x M numbers (in the backward three more such
products: the tokens' gradient, the expert outputs' gradient, the combine
weights' gradient). On CPU those products cost about a third as much as
the experts themselves (4 experts of 256 -> 1024 -> 256, 512 tokens per
rank: bench/moe/README.md). A route instead names, for choice r of token
s, its expert (-1 where the token found the expert full), its slot and
its weight; then

- dispatch writes token s into row e*C + c of an [E*C (+1), M] buffer
  (index_copy; the extra row takes every dropped route and is cut off),
- combine reads row e*C + c back (index_select of the expert output padded
  with one zero row, which the dropped routes read), scales it by the
  route's weight and sums over a token's k routes.

Both are copies of S x k rows. The values are the einsums' exactly: a
token sits in one slot per route (a one-hot row times its token is the
token), and for k = 1 the combine is one product. For k >= 2 the sum of a
token's k weighted rows is the einsum's sum, up to the order of the
additions. The combine's products and sum are in fp32 (the weights' dtype)
and rounded once to the tokens' dtype. DeepSpeed 0.19.8's MOELayer moved
to the same kind of index-based dispatch (its `sparse_routes`), so this is
also the computation its layer does.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class GateOutput(NamedTuple):
    """What a gating function returns (see [Note: the gating outputs] in
    gating.py), in the order of DeepSpeed's gating functions' tuples."""

    l_aux: torch.Tensor
    combine_weights: torch.Tensor
    dispatch_mask: torch.Tensor
    exp_counts: torch.Tensor


class Routes(NamedTuple):
    """A gate's decisions for S tokens, k choices each ([Note: routes, not
    [S, E, C] masks]).

    l_aux: the load-balancing loss (fp32 scalar). experts: [k, S] int64,
    the expert of choice r of token s, -1 where that choice was dropped
    (or the token masked out). slots: [k, S] int64, its slot in that
    expert (0 where dropped). weights: [k, S] fp32, its combine weight
    (0 where dropped; differentiable w.r.t. the gate). capacity: C.
    num_experts: E. exp_counts: [E] int64 on the CPU, token choices per
    expert before drops.
    """

    l_aux: torch.Tensor
    experts: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor
    capacity: int
    num_experts: int
    exp_counts: torch.Tensor

    def flat_slots(self) -> torch.Tensor:
        """[k, S] int64: row e*C + c of the [E*C, M] expert buffer for each
        route, E*C (the row past the end) where dropped."""
        scratch = self.num_experts * self.capacity
        return torch.where(self.experts >= 0, self.experts * self.capacity + self.slots, scratch)

    def kept_counts(self) -> torch.Tensor:
        """[E] int64: the routes that found a slot, per expert."""
        return torch.bincount(self.experts.reshape(-1) + 1, minlength=self.num_experts + 1)[1:]

    def dense(self) -> GateOutput:
        """The [S, E, C] form: combine_weights[s, e, c] = the weight of the
        route of token s to slot c of expert e (0 elsewhere), dispatch_mask
        = combine_weights != 0 (see [Note: the gating outputs])."""
        k, num_tokens = self.experts.shape
        width = self.num_experts * self.capacity
        flat = self.weights.new_zeros(num_tokens, width + 1).scatter(1, self.flat_slots().t(), self.weights.t())
        combine = flat[:, :width].reshape(num_tokens, self.num_experts, self.capacity)
        return GateOutput(self.l_aux, combine, combine.bool(), self.exp_counts)


def pick(choice: torch.Tensor, kept: torch.Tensor, locations: torch.Tensor,
         weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One choice per token as a route: `choice` [S] int64 (the expert
    chosen), `kept` [S, E] (nonzero where the token kept its place at that
    expert), `locations` [S, E] (its slot there), `weight` [S] (its combine
    weight). Returns (expert [S], -1 where not kept; slot [S], 0 where not
    kept; weight [S], 0 where not kept)."""
    column = choice.unsqueeze(1)
    found = kept.gather(1, column).squeeze(1) != 0
    expert = torch.where(found, choice, -1)
    slot = torch.where(found, locations.gather(1, column).squeeze(1), 0)
    return expert, slot, torch.where(found, weight, 0.0)


def dispatch(tokens: torch.Tensor, flat_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """tokens [S, M] -> [num_slots, M] (num_slots = E*C), route r of token s
    written to row flat_slots[r, s], zeros in the empty slots;
    differentiable w.r.t. `tokens`. flat_slots [k, S] from
    Routes.flat_slots (num_slots for a dropped route)."""
    routes = flat_slots.shape[0]
    source = tokens if routes == 1 else tokens.repeat(routes, 1)  # row r*S + s: route r of token s
    buffer = tokens.new_zeros(num_slots + 1, tokens.shape[1]).index_copy(0, flat_slots.reshape(-1), source)
    return buffer[:num_slots]


def combine(expert_out: torch.Tensor, flat_slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """expert_out [E*C, M] (the tokens' own slots, back from the experts)
    -> [S, M] in expert_out's dtype: for each token, the sum over its
    routes of weight x its slot's row (zero for a dropped route).
    flat_slots [k, S], weights [k, S] fp32 (Routes)."""
    routes, num_tokens = flat_slots.shape
    padded = F.pad(expert_out, (0, 0, 0, 1))  # the row dropped routes read: zeros
    rows = padded.index_select(0, flat_slots.reshape(-1)).view(routes, num_tokens, -1)
    return (rows * weights.unsqueeze(-1)).sum(dim=0).to(expert_out.dtype)

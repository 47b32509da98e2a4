"""The MoE layer's dispatch and combine by routes
(dsrun/runtime/parallel/expert/routes.py) against GShard's dense einsums
over the gate's [S, E, C] combine weights: the same values and gradients,
with tokens dropped (over capacity, masked out) and k = 1, 2, 3."""
from __future__ import annotations

import pytest
import torch

from dsrun.runtime.parallel.expert.gating import top1_routes, top2_routes, topk_routes
from dsrun.runtime.parallel.expert.routes import combine, dispatch

TOKENS, EXPERTS, WIDTH = 24, 4, 6


def _routes(k: int, logits: torch.Tensor):
    if k == 1:  # a quarter of the tokens masked out, the rest over capacity at expert 0
        used = (torch.arange(TOKENS) % 4 != 3).float()
        return top1_routes(logits, 0.5, 1, use_rts=False, used_token=used)
    if k == 2:
        return top2_routes(logits, 0.5, 1, second_expert_sampling=False)
    return topk_routes(logits, k, 0.5, 1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_routes_dispatch_and_combine_equal_the_dense_einsums(k):
    torch.manual_seed(k)
    logits = (torch.randn(TOKENS, EXPERTS) + torch.tensor([2.0, 0.0, 0.0, -1.0])).requires_grad_()
    tokens = torch.randn(TOKENS, WIDTH, requires_grad=True)
    weight = torch.randn(WIDTH, WIDTH)  # a stand-in for the experts: a map scaled differently per slot

    def run(sparse: bool):
        routes = _routes(k, logits)
        cap = routes.capacity
        scale = torch.linspace(0.5, 1.5, EXPERTS * cap).unsqueeze(1)
        if sparse:
            slots = routes.flat_slots()
            out = dispatch(tokens, slots, EXPERTS * cap) @ weight * scale
            return routes, combine(out, slots, routes.weights)
        dense = routes.dense()
        out = (torch.einsum("sec,sm->ecm", dense.dispatch_mask.float(), tokens).reshape(-1, WIDTH) @ weight * scale)
        return routes, torch.einsum("sec,ecm->sm", dense.combine_weights, out.reshape(EXPERTS, cap, WIDTH))

    routes, got = run(sparse=True)
    dense = routes.dense()
    kept = int(dense.dispatch_mask.sum())
    assert 0 < kept < TOKENS * k  # some routes dropped, some kept
    assert torch.equal(routes.kept_counts(), dense.dispatch_mask.sum(dim=(0, 2)))
    assert routes.experts.shape == routes.slots.shape == routes.weights.shape == (k, TOKENS)
    assert bool(((routes.experts >= 0) == (routes.weights != 0)).all())  # a dropped route weighs 0
    grads = torch.autograd.grad(got.square().sum(), (tokens, logits))
    _, want = run(sparse=False)
    want_grads = torch.autograd.grad(want.square().sum(), (tokens, logits))
    if k == 1:  # one product per token: exactly the einsum's values
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(grads, want_grads):
        # A token left with one route has weight g/g = 1: its logits' gradient is zero up to rounding,
        # which differs between the two orders of summation.
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))

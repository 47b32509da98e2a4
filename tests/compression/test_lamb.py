"""Lamb (dsrun.ops.lamb.FusedLamb) against a plain reference written here."""
from __future__ import annotations

import math

import pytest
import torch

from dsrun.ops.lamb import FusedLamb
from dsrun.runtime.config import load_config
from dsrun.runtime.optim.optimizers import build_optimizer


def reference_lamb(weights, grads_per_step, lr, betas, eps, wd, bias_correction, min_coeff, max_coeff,
                   eps_inside_sqrt=False):
    """LAMB as DeepSpeed defines it, one tensor at a time, written out plainly."""
    weights = [w.clone().double() for w in weights]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    b1, b2 = betas
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = torch.sqrt(v[i] + eps) if eps_inside_sqrt else torch.sqrt(v[i]) + eps
            u = m[i] / denom + wd * weights[i]
            wn, un = float(torch.linalg.norm(weights[i])), float(torch.linalg.norm(u))
            ratio = 1.0 if wn == 0 or un == 0 else min(max(wn / un, min_coeff), max_coeff)
            step = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else lr
            weights[i] = weights[i] - step * ratio * u
    return weights


def _grads(shapes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


@pytest.mark.parametrize("bias_correction, wd, eps_inside_sqrt, coeffs", [
    (True, 0.0, False, (0.01, 10.0)),
    (True, 0.1, False, (0.01, 10.0)),
    (False, 0.01, True, (0.01, 10.0)),
    (True, 0.0, False, (0.5, 0.6)),   # the clamp binds
])
def test_fused_lamb_matches_reference(bias_correction, wd, eps_inside_sqrt, coeffs):
    shapes = [(7, 5), (5,), (3, 4, 2)]
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in shapes]
    init[1].zero_()  # a zero weight: ratio 1
    grads = _grads(shapes, 6)
    params = [torch.nn.Parameter(w.clone()) for w in init]
    opt = FusedLamb(params, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=wd,
                    bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                    min_coeff=coeffs[0], max_coeff=coeffs[1])
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    want = reference_lamb(init, grads, 0.01, (0.9, 0.99), 1e-6, wd, bias_correction, *coeffs,
                          eps_inside_sqrt=eps_inside_sqrt)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)
    assert len(opt.get_lamb_coeffs()) == len(shapes)
    if coeffs == (0.5, 0.6):
        assert all(c in (0.5, 0.6, 1.0) for c in opt.get_lamb_coeffs())


def test_segments_give_the_same_result_as_separate_tensors():
    shapes = [(6, 3), (4,), (2, 5)]
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = _grads(shapes, 4, seed=3)
    separate = [torch.nn.Parameter(w.clone()) for w in init]
    flat = torch.nn.Parameter(torch.cat([w.reshape(-1) for w in init]))
    a = FusedLamb(separate, lr=0.02, weight_decay=0.01)
    b = FusedLamb([flat], lr=0.02, weight_decay=0.01)
    bounds, lo = [], 0
    for w in init:
        bounds.append((lo, lo + w.numel()))
        lo += w.numel()
    b.set_segments(flat, bounds)
    for gs in grads:
        for p, g in zip(separate, gs):
            p.grad = g.clone()
        flat.grad = torch.cat([g.reshape(-1) for g in gs])
        a.step()
        b.step()
    torch.testing.assert_close(flat.detach(), torch.cat([p.detach().reshape(-1) for p in separate]))
    assert a.get_lamb_coeffs() == pytest.approx(b.get_lamb_coeffs())
    with pytest.raises(ValueError, match="segment"):
        b.set_segments(flat, [(0, 5), (3, 8)])


def test_max_grad_norm_divides_gradients_above_the_norm():
    p = torch.nn.Parameter(torch.ones(4))
    q = torch.nn.Parameter(torch.ones(4))
    a = FusedLamb([p], lr=0.1, max_grad_norm=1.0)
    b = FusedLamb([q], lr=0.1)
    p.grad = torch.full((4,), 3.0)
    q.grad = torch.full((4,), 3.0) / (6.0 + 1e-6)
    a.step(grad_norms=[6.0])
    b.step()
    torch.testing.assert_close(p.detach(), q.detach())


def test_config_lamb_builds_fused_lamb_with_deepspeed_params():
    cfg = load_config({"train_batch_size": 2, "optimizer": {"type": "lamb", "params": {
        "lr": 1e-3, "bias_correction": True, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
        "max_grad_norm": 1.0, "max_coeff": 10.0, "min_coeff": 0.01}}}, world_size=1)
    assert cfg.optimizer.type == "Lamb"
    opt = build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), [torch.nn.Parameter(torch.ones(2))])
    assert isinstance(opt, FusedLamb) and opt.param_groups[0]["betas"] == (0.9, 0.999)
    with pytest.raises(Exception, match="max_coef.*accepted"):
        build_optimizer("Lamb", {"max_coef": 1.0}, [torch.nn.Parameter(torch.ones(2))])


def test_deepspeed_import_path():
    import dsrun.ops
    assert dsrun.ops.lamb.FusedLamb is FusedLamb

"""LAMB: `FusedLamb` under DeepSpeed's name (`deepspeed.ops.lamb.FusedLamb`).

You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT
in 76 minutes" (ICLR 2020), Algorithm 2, in DeepSpeed's variant: Adam's
moments without bias correction inside the trust ratio, the bias
correction folded into the step size, and the trust ratio clamped to
[min_coeff, max_coeff]. Per tensor (per layer) with gradient g, moments
m, v and step t:

    g  = grad / combined_scale
    m  = β1·m + (1-β1)·g            v = β2·v + (1-β2)·g²
    u  = m / (√v + eps) + wd·θ      (√(v + eps) with eps_inside_sqrt)
    r  = clamp(‖θ‖ / ‖u‖, min_coeff, max_coeff)   (1 when either norm is 0)
    θ ← θ - lr·√(1-β2^t)/(1-β1^t)·r·u   (lr·r·u without bias_correction)

There is no LAMB kernel in csrc/: the arithmetic is PyTorch on any device.

[Note: trust-ratio segments]
The trust ratio belongs to one layer's tensor. When the engine hands the
optimizer flat fp32 master buffers that hold several parameters back to
back (bf16/fp16 at ZeRO stage 0), it tells the optimizer where each
parameter lies with `set_segments(tensor, [(lo, hi), ...])` (element
ranges of the flattened tensor), and every range gets its own ratio, so the
result is the same as over separate tensors. A tensor without segments is
one layer.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from dsrun.ops.optimizer_base import OptimizerBase

__all__ = ["FusedLamb", "lamb_trust_ratios", "Segmented"]


class Segmented:
    """Mixin: per-tensor element ranges for layer-wise ratios (see [Note: trust-ratio segments])."""

    def _segments_of(self, p: torch.Tensor) -> list[tuple[int, int]]:
        return getattr(self, "_segments", {}).get(id(p)) or [(0, p.numel())]

    def set_segments(self, tensor: torch.Tensor, segments: Sequence[tuple[int, int]]) -> None:
        """Treat element ranges [lo, hi) of `tensor` (flattened) as separate layers.

        Raises:
            ValueError: a range is empty, out of bounds or overlaps the previous.
        """
        last = 0
        for lo, hi in segments:
            if not last <= lo < hi <= tensor.numel():
                raise ValueError(f"segment ({lo}, {hi}) of a {tensor.numel()}-element tensor must be "
                                 "non-empty, in bounds and after the previous one")
            last = hi
        if not hasattr(self, "_segments"):
            self._segments: dict[int, list[tuple[int, int]]] = {}
        self._segments[id(tensor)] = [(int(lo), int(hi)) for lo, hi in segments]


def lamb_trust_ratios(weight: torch.Tensor, update: torch.Tensor, segments: list[tuple[int, int]],
                      min_coeff: float, max_coeff: float) -> list[float]:
    """‖weight‖/‖update‖ per segment of the flattened tensors, clamped to
    [min_coeff, max_coeff]; 1.0 where either norm is zero (DeepSpeed's rule).

    weight, update: same shape, fp32. Returns one float per segment.
    """
    w, u = weight.reshape(-1), update.reshape(-1)
    norms = torch.stack([torch.stack([w[lo:hi].norm(), u[lo:hi].norm()]) for lo, hi in segments]).tolist()
    return [1.0 if wn == 0 or un == 0 else min(max(wn / un, min_coeff), max_coeff) for wn, un in norms]


def apply_segment_scaled(param: torch.Tensor, update: torch.Tensor, segments: list[tuple[int, int]],
                         coeffs: list[float], step_size: float) -> None:
    """param[lo:hi] -= step_size·coeff·update[lo:hi] for each segment (in place, flat views)."""
    p, u = param.view(-1), update.reshape(-1)
    for (lo, hi), c in zip(segments, coeffs):
        p[lo:hi].add_(u[lo:hi], alpha=-step_size * c)


class FusedLamb(Segmented, OptimizerBase):
    """LAMB with DeepSpeed's `FusedLamb` signature and arithmetic (module docstring).

    Args:
        params: parameters or parameter-group dicts (fp32 recommended; 16-bit
            parameters keep fp32 moments and are updated in fp32).
        lr: learning rate (1e-3). bias_correction: fold √(1-β2^t)/(1-β1^t)
            into the step (True). betas: (β1, β2) = (0.9, 0.999).
        eps: 1e-8. eps_inside_sqrt: √(v+eps) instead of √v+eps (False).
        weight_decay: wd added to the update (decoupled, inside the ratio).
        max_grad_norm: when > 0 and `step(grad_norms=...)` gives the norm,
            gradients are divided by norm/max_grad_norm above it (0).
        max_coeff, min_coeff: trust-ratio bounds (10.0, 0.01).
        amsgrad: must be False (not part of LAMB).

    Raises:
        ValueError: amsgrad, lr < 0, betas outside [0, 1), eps <= 0,
            min_coeff > max_coeff; at step, a sparse gradient.
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("FusedLamb: amsgrad is not part of LAMB; remove it")
        if lr < 0 or eps <= 0 or len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedLamb: need lr >= 0, eps > 0, betas in [0, 1); got lr={lr}, eps={eps}, "
                             f"betas={betas}")
        if min_coeff > max_coeff:
            raise ValueError(f"FusedLamb: min_coeff={min_coeff} > max_coeff={max_coeff}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                                      max_coeff=max_coeff, min_coeff=min_coeff))
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.lamb_coeffs: list[float] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios of the last step, one per tensor (per segment), in order."""
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, scale: float = 1.0, grad_norms=None):
        """One LAMB update of every parameter with a gradient.

        Args:
            closure: re-evaluates the loss (returned).
            scale: gradients are divided by it (a loss scale).
            grad_norms: per group, the (scaled) global gradient norm, used
                with max_grad_norm > 0 (DeepSpeed's clipping hook).
        """
        loss = self.closure_loss(closure)
        self.lamb_coeffs.clear()
        norms = grad_norms if grad_norms is not None else [None] * len(self.param_groups)
        for group, norm in zip(self.param_groups, norms):
            combined = scale
            if group["max_grad_norm"] > 0 and norm is not None:
                clip = (norm / scale + 1e-6) / group["max_grad_norm"]
                combined = clip * scale if clip > 1 else scale
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FusedLamb does not support sparse gradients")
                self._update(p, group, combined)
        return loss

    def _update(self, p: torch.Tensor, group: dict, combined_scale: float) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                   memory_format=torch.contiguous_format)
        state["step"] += 1
        t = int(state["step"].item())
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        g = p.grad.float()
        if combined_scale != 1.0:
            g = g / combined_scale
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v + group["eps"]).sqrt_() if self.eps_mode == 0 else v.sqrt().add_(group["eps"])
        w = p.float()
        update = m / denom
        if group["weight_decay"] != 0:
            update.add_(w, alpha=group["weight_decay"])
        step_size = group["lr"]
        if group["bias_correction"]:
            step_size *= math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        segments = self._segments_of(p)
        coeffs = lamb_trust_ratios(w, update, segments, group["min_coeff"], group["max_coeff"])
        self.lamb_coeffs.extend(coeffs)
        if w is p:
            apply_segment_scaled(p, update, segments, coeffs, step_size)
        else:
            apply_segment_scaled(w, update, segments, coeffs, step_size)
            p.copy_(w)

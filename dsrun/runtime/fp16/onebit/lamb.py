"""1-bit LAMB (`"type": "OneBitLamb"`), at DeepSpeed's path deepspeed.runtime.fp16.onebit.lamb.

Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
Training with LAMB's Convergence Speed" (HiPC 2022), Algorithm 1, with
DeepSpeed's arithmetic. Per layer θ (a tensor, or a segment of a flat
buffer: see [Note: trust-ratio segments] in dsrun/ops/lamb.py):

- Warm-up, steps 1..freeze_step: LAMB on all-reduced gradients, without
  bias correction: u = m/(√v + eps) + wd·θ, ratio r = clamp(‖θ‖/‖u‖,
  min_coeff, max_coeff), θ ← θ - lr·r·u; every ratio other than 1 feeds
  an exponential average c = coeff_beta·c + (1-coeff_beta)·r. At step
  freeze_step the variance is copied into a "fresh" variance v'.
- Compression, later steps: v and c are frozen. Each layer's momentum is
  multiplied by a scaling coefficient (the mean RMS of all layers'
  momenta at the end of warm-up over this layer's), updated with the
  local gradient, averaged 1-bit compressed and scaled back. The gradient
  is reconstructed from the momentum change, g' = (m - β1·m_prev)/(1-β1),
  and updates v'. The ratio is c·f, where f = max((√v + eps)/(√v' + eps))
  (mixed with 1 by ‖m/(√v+eps)‖/‖u‖ under weight decay) is clamped to
  [factor_min, factor_max] and to within factor_threshold of the previous
  f.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from dsrun.ops.lamb import Segmented, apply_segment_scaled, lamb_trust_ratios
from dsrun.runtime import comm
from dsrun.runtime.fp16.onebit.adam import check_adam_args, denominator
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer

log = logging.getLogger("dsrun.onebit")

# Columns of the per-layer scalars: the frozen ratio average, the last factor, the momentum scaling.
_FREEZE, _LAST, _SCALING = 0, 1, 2


class OnebitLamb(Segmented, CompressedCommOptimizer):
    """1-bit LAMB with DeepSpeed's signature (module docstring).

    Args:
        params: parameters or parameter-group dicts.
        deepspeed: ignored (dsrun's engine attaches itself).
        lr (1e-3), freeze_step (100000), bias_correction (accepted, not
            applied as in DeepSpeed), betas, eps, eps_inside_sqrt,
            weight_decay, max_grad_norm (unused), amsgrad (must be False).
        max_coeff, min_coeff: trust-ratio bounds in warm-up (10.0, 0.01).
        coeff_beta: averaging of warm-up ratios (0.9).
        factor_max, factor_min, factor_threshold: bounds of the
            compression-stage factor and its largest relative change per
            step (4.0, 0.5, 0.1).
        cuda_aware, comm_backend_name: accepted (see OnebitAdam).

    Raises:
        ValueError: bad hyperparameters (before any communication).
    """

    def __init__(self, params, deepspeed=None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl", coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1) -> None:
        check_adam_args("OnebitLamb", lr, betas, eps, amsgrad)
        if freeze_step < 0 or min_coeff > max_coeff or factor_min > factor_max or not 0 <= coeff_beta < 1:
            raise ValueError("OnebitLamb: need freeze_step >= 0, min_coeff <= max_coeff, factor_min <= "
                             f"factor_max and coeff_beta in [0, 1); got {freeze_step}, {min_coeff}, "
                             f"{max_coeff}, {factor_min}, {factor_max}, {coeff_beta}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                                      max_coeff=max_coeff, min_coeff=min_coeff))
        self.freeze_step = int(freeze_step)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self.coeff_beta = float(coeff_beta)
        self.factor_max, self.factor_min = float(factor_max), float(factor_min)
        self.factor_threshold = float(factor_threshold)
        self._setup_comm(cuda_aware, comm_backend_name)
        self._layer: dict[tuple[int, int], torch.Tensor] = {}  # fp32 [segments, 3], same on every rank
        self.lamb_coeffs: list[float] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Ratios of the last step, one per layer, in order."""
        return list(self.lamb_coeffs)

    def gradients_averaged(self) -> bool:
        return self.steps_done() < self.freeze_step

    def _layer_scalars(self, key: tuple[int, int], p: torch.Tensor) -> torch.Tensor:
        if key not in self._layer:
            table = torch.zeros(len(self._segments_of(p)), 3, dtype=torch.float64)
            table[:, _LAST] = 1.0
            table[:, _SCALING] = 1.0
            self._layer[key] = table
        return self._layer[key]

    def _set_scaling(self) -> None:
        """Momentum scaling per layer: mean RMS over all layers / this layer's RMS."""
        rms = {}
        for gi, pi, _, p in self._indexed():
            m = self.state[p]["exp_avg"].view(-1)
            rms[(gi, pi)] = [float(m[lo:hi].norm()) / (hi - lo) ** 0.5 for lo, hi in self._segments_of(p)]
        values = [r for rs in rms.values() for r in rs]
        united = sum(values) / max(len(values), 1)
        for (gi, pi), rs in rms.items():
            p = self.param_groups[gi]["params"][pi]
            self._layer_scalars((gi, pi), p)[:, _SCALING] = torch.tensor(
                [united / r if r > 0 else 1.0 for r in rs], dtype=torch.float64)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One 1-bit LAMB step (collective after warm-up)."""
        loss = self.closure_loss(closure)
        self.lamb_coeffs.clear()
        compressing = not self.gradients_averaged()
        if compressing and self.steps_done() == self.freeze_step:
            self._set_scaling()
            if comm.get_rank() == 0:
                log.info("OnebitLamb: step %d: variance and ratios frozen, momentum exchanged 1-bit "
                         "compressed from now on", self.freeze_step + 1)
        for gi, pi, group, p, state in self._stepped():
            table = self._layer_scalars((gi, pi), p)
            if compressing:
                coeffs = self._compressed_step((gi, pi), group, p, state, table)
            else:
                coeffs = self._warmup_step(group, p, state, table)
            self.lamb_coeffs.extend(coeffs)
        return loss

    def _warmup_step(self, group: dict, p: torch.Tensor, state: dict, table: torch.Tensor) -> list[float]:
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        g = p.grad.float()
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if int(state["step"]) == self.freeze_step:
            state["exp_avg_sq_fresh"] = v.clone()
        w = p.float()
        update = m / denominator(v, group["eps"], self.eps_inside_sqrt)
        if group["weight_decay"] > 0:
            update.add_(w, alpha=group["weight_decay"])
        segments = self._segments_of(p)
        coeffs = lamb_trust_ratios(w, update, segments, group["min_coeff"], group["max_coeff"])
        for row, c in enumerate(coeffs):
            if c != 1.0:
                table[row, _FREEZE] = self.coeff_beta * table[row, _FREEZE] + (1 - self.coeff_beta) * c
        self._apply(p, w, update, segments, coeffs, group["lr"])
        return coeffs

    def _compressed_step(self, key, group: dict, p: torch.Tensor, state: dict, table: torch.Tensor) -> list[float]:
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        fresh = state.setdefault("exp_avg_sq_fresh", torch.zeros_like(v))
        segments = self._segments_of(p)
        m_prev = m.clone()
        m.mul_(beta1).add_(p.grad.float(), alpha=1 - beta1)
        flat = m.view(-1)
        scaling = table[:, _SCALING].tolist()
        for (lo, hi), c in zip(segments, scaling):
            flat[lo:hi].mul_(c)
        if self.world_size() > 1:
            self.compressed_mean(key, group, p, m)
        for (lo, hi), c in zip(segments, scaling):
            flat[lo:hi].div_(c)
        g = (m - m_prev * beta1).div_(1 - beta1)
        fresh.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = denominator(v, group["eps"], self.eps_inside_sqrt)
        w = p.float()
        prelim = m / denom
        update = prelim + w * group["weight_decay"] if group["weight_decay"] > 0 else prelim
        ratio_of = denom / denominator(fresh, group["eps"], self.eps_inside_sqrt)
        coeffs = []
        for row, (lo, hi) in enumerate(segments):
            factor = float(ratio_of.view(-1)[lo:hi].max())
            if group["weight_decay"] > 0:
                un = float(update.view(-1)[lo:hi].norm())
                mix = min(1.0, float(prelim.view(-1)[lo:hi].norm()) / un) if un > 0 else 1.0
                factor = factor * mix + (1.0 - mix)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = float(table[row, _LAST])
            factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
            table[row, _LAST] = factor
            coeffs.append(float(table[row, _FREEZE]) * factor)
        self._apply(p, w, update, segments, coeffs, group["lr"])
        return coeffs

    @staticmethod
    def _apply(p, w, update, segments, coeffs, lr) -> None:
        apply_segment_scaled(w, update, segments, coeffs, lr)
        if w is not p:
            p.copy_(w)

    # ---- checkpoints: per-layer scalars are the same on every rank ----------------------
    def replicated_extras(self) -> dict[str, torch.Tensor]:
        """Per-layer scalars (fp64 [layers, 3]: ratio average, last factor,
        momentum scaling), identical on every rank."""
        return {f"g{gi}.t{pi}.layer_scalars": t for (gi, pi), t in sorted(self._layer.items())}

    def load_replicated_extras(self, saved: dict[str, torch.Tensor]) -> None:
        """Restore `replicated_extras()` (from any rank's copy)."""
        params = {(gi, pi): p for gi, pi, _, p in self._indexed()}
        self._layer.clear()
        for key, value in saved.items():
            gpart, tpart, _ = key.split(".", 2)
            index = (int(gpart[1:]), int(tpart[1:]))
            if index in params and value.numel() == 3 * len(self._segments_of(params[index])):
                self._layer[index] = value.to(torch.float64).reshape(-1, 3).clone()

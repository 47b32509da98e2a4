"""Lion optimizers: `Lion`, and DeepSpeed's names `DeepSpeedCPULion` and `FusedLion`.

All three run the same PyTorch arithmetic (there is no Lion kernel in
csrc/): one sign, one lerp and one or two in-place updates per parameter.
They differ in what DeepSpeed's classes of the same names promise:
DeepSpeedCPULion takes CPU parameters and keeps fp32 momentum by default;
FusedLion takes parameters on any device, keeps momentum in the parameter's
dtype, and `zero_grad()` sets gradients to None.
"""
from __future__ import annotations

from typing import Callable

import torch

from dsrun.ops.optimizer_base import OptimizerBase


class Lion(OptimizerBase):
    """Lion with decoupled weight decay (Chen et al. 2023, "Symbolic Discovery of
    Optimization Algorithms", Algorithm 2).

    Per parameter θ with gradient g and momentum m (same shape as θ):
        c = β1·m + (1-β1)·g
        θ ← θ - lr·(sign(c) + λ·θ)
        m ← β2·m + (1-β2)·g

    The momentum has θ's dtype. A 16-bit θ is updated in fp32 and rounded
    back once per step.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate (default 1e-3, DeepSpeed's FusedLion default; the
            paper suggests 3-10x smaller than AdamW's).
        betas: (β1, β2) interpolation factors, default (0.9, 0.999).
        weight_decay: λ, decoupled, default 0.

    Raises:
        ValueError: lr < 0, betas outside [0, 1), weight_decay < 0; at step,
            a sparse gradient.
    """

    # Momentum dtype: None = the parameter's dtype (DeepSpeedCPULion may set fp32).
    _state_dtype: torch.dtype | None = None

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0) -> None:
        name = type(self).__name__
        if lr < 0:
            raise ValueError(f"{name}: lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{name}: betas must be two values in [0, 1), got {betas}")
        if weight_decay < 0:
            raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One Lion update of every parameter with a gradient; returns closure's loss."""
        loss = self.closure_loss(closure)
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=self._state_dtype or p.dtype,
                                                        memory_format=torch.preserve_format)
                m = state["exp_avg"]
                g = p.grad if p.grad.dtype == m.dtype else p.grad.to(m.dtype)
                update = torch.lerp(g, m, beta1).sign_()  # β1·m + (1-β1)·g, then sign
                theta = p if p.dtype == torch.float32 else p.float()
                if wd:
                    theta.mul_(1 - lr * wd)
                theta.add_(update, alpha=-lr)
                if theta is not p:
                    p.copy_(theta)  # one rounding to the 16-bit dtype per step
                m.lerp_(g, 1 - beta2)  # β2·m + (1-β2)·g
        return loss


class DeepSpeedCPULion(Lion):
    """DeepSpeed's `deepspeed.ops.lion.DeepSpeedCPULion` (same signature), in PyTorch.

    The update of `Lion` over CPU parameters (fp32, bf16 or fp16, any
    shape). With fp32_optimizer_states=True (the default) the momentum is
    fp32 whatever the parameter's dtype; False keeps it in the parameter's
    dtype.

    Args:
        params: parameters or parameter-group dicts (CPU tensors).
        lr, betas, weight_decay: as `Lion` (defaults 1e-3, (0.9, 0.999), 0).
        fp32_optimizer_states: fp32 momentum (default True).

    Raises:
        ValueError: a parameter not on the CPU, or a bad hyperparameter (see Lion).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True) -> None:
        self.fp32_optimizer_states = fp32_optimizer_states
        self._state_dtype = torch.float32 if fp32_optimizer_states else None
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group; raises ValueError for a parameter not on the CPU."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.device.type != "cpu":
                raise ValueError(f"DeepSpeedCPULion needs CPU parameters, got one on {p.device}; "
                                 "use FusedLion for GPU parameters")


class FusedLion(Lion):
    """DeepSpeed's `deepspeed.ops.lion.FusedLion` (same signature), in PyTorch.

    The update of `Lion` over parameters on any device, momentum in the
    parameter's dtype (as DeepSpeed's FusedLion). No fused kernel: one
    elementwise pass per operation and parameter.

    Args:
        params: parameters or parameter-group dicts.
        lr, betas, weight_decay: as `Lion` (defaults 1e-3, (0.9, 0.999), 0).
        set_grad_none: `zero_grad()` sets gradients to None (default True)
            rather than zeroing them.

    Raises:
        ValueError: a bad hyperparameter (see Lion).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients: to None when `set_to_none` (default: `set_grad_none`), else to zeros."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

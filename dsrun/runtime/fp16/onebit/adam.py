"""1-bit Adam (`"type": "OneBitAdam"`), at DeepSpeed's path deepspeed.runtime.fp16.onebit.adam.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed" (ICML 2021), Algorithm 1, with DeepSpeed's
arithmetic. Per tensor θ with gradient g, momentum m and variance v:

- Warm-up, steps 1..freeze_step: the engine all-reduces g (average), then
  plain Adam without bias correction (DeepSpeed's 1-bit Adam applies none,
  whatever `bias_correction` says):
      m = β1·m + (1-β1)·g,  v = β2·v + (1-β2)·g²
- Compression, later steps: v stays frozen; each rank updates m with its
  local g and the ranks exchange m through the error-compensated 1-bit
  all-reduce (dsrun.runtime.comm.compressed), masked (see [Note: momentum
  masks] in base.py).
- Both: θ ← θ - lr·(m / (√v + eps) + weight_decay·θ)  (√(v + eps) with
  eps_inside_sqrt).

DeepSpeed's first step() only initialises its buffers and leaves the
parameters alone; dsrun's first step is an ordinary Adam step.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from dsrun.runtime import comm
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer

log = logging.getLogger("dsrun.onebit")


def check_adam_args(name: str, lr: float, betas, eps: float, amsgrad: bool) -> None:
    """Raise ValueError for arguments no Adam variant accepts."""
    if amsgrad:
        raise ValueError(f"{name} does not support the AMSGrad variant; remove amsgrad")
    if lr < 0 or eps <= 0 or len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: need lr >= 0, eps > 0 and betas in [0, 1); got lr={lr}, eps={eps}, "
                         f"betas={betas}")


def denominator(exp_avg_sq: torch.Tensor, eps: float, eps_inside_sqrt: bool) -> torch.Tensor:
    """√v + eps, or √(v + eps) (a new tensor)."""
    return (exp_avg_sq + eps).sqrt_() if eps_inside_sqrt else exp_avg_sq.sqrt().add_(eps)


def apply_update(p: torch.Tensor, update: torch.Tensor, step_size: float) -> None:
    """θ ← θ - step_size·update, computed in fp32 for a 16-bit θ."""
    if p.dtype == torch.float32:
        p.add_(update, alpha=-step_size)
    else:
        p.copy_(p.float().add_(update, alpha=-step_size))


class OnebitAdam(CompressedCommOptimizer):
    """1-bit Adam with DeepSpeed's signature (module docstring).

    Args:
        params: parameters or parameter-group dicts.
        deepspeed: DeepSpeed passes its engine; dsrun's engine attaches
            itself instead, so any value is ignored.
        lr: 1e-3. freeze_step: warm-up steps with full Adam (100000).
        bias_correction: accepted; not applied (as in DeepSpeed).
        betas: (0.9, 0.999). eps: 1e-8. eps_inside_sqrt: False.
        weight_decay: added to the update (0). max_grad_norm: accepted,
            unused as in DeepSpeed (use the config's gradient_clipping).
        amsgrad: must be False.
        cuda_aware, comm_backend_name: DeepSpeed's transport choice ("nccl",
            "mpi", "hccl", "compressed"); dsrun sends through
            dsrun.runtime.comm whatever they say.

    Raises:
        ValueError: amsgrad, bad lr/eps/betas, freeze_step < 0, an unknown
            comm_backend_name; at step, a sparse gradient.
    """

    def __init__(self, params, deepspeed=None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        check_adam_args("OnebitAdam", lr, betas, eps, amsgrad)
        if freeze_step < 0:
            raise ValueError(f"OnebitAdam: freeze_step must be >= 0, got {freeze_step}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, max_grad_norm=max_grad_norm))
        self.freeze_step = int(freeze_step)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self._setup_comm(cuda_aware, comm_backend_name)

    def gradients_averaged(self) -> bool:
        return self.steps_done() < self.freeze_step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One 1-bit Adam step (collective after warm-up: every rank calls it)."""
        loss = self.closure_loss(closure)
        compressing = not self.gradients_averaged()
        if compressing and self.steps_done() == self.freeze_step and comm.get_rank() == 0:
            log.info("OnebitAdam: step %d: variance frozen, momentum exchanged 1-bit compressed from now on",
                     self.freeze_step + 1)
        world = self.world_size()
        for gi, pi, group, p, state in self._stepped():
            beta1, beta2 = group["betas"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            g = p.grad.float()
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            if not compressing:
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            elif world > 1:
                self.compressed_mean((gi, pi), group, p, m)
            update = m / denominator(v, group["eps"], self.eps_inside_sqrt)
            if group["weight_decay"] > 0:
                update.add_(p.float(), alpha=group["weight_decay"])
            apply_update(p, update, group["lr"])
        return loss

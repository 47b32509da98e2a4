"""DeepSpeed's `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`, on torch's Adagrad."""
from __future__ import annotations

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """Adagrad with DeepSpeed's signature; the arithmetic is torch.optim.Adagrad's.

    There is no Adagrad kernel in dsrun: this is torch.optim.Adagrad with
    lr_decay=0 and initial_accumulator_value=0, run by torch's fused CPU
    implementation when every parameter is a CPU tensor at construction,
    else by its default (foreach) one. Per parameter θ with gradient g and
    accumulator s (fp32, θ's shape, starting at 0):
        g ← g + weight_decay·θ
        s ← s + g²
        θ ← θ - lr·g / (sqrt(s) + eps)

    Args:
        model_params: parameters or parameter-group dicts (fp32 tensors).
        lr: learning rate (default 1e-2).
        eps: added to the denominator (default 1e-10).
        weight_decay: L2 penalty added to the gradient (default 0).
        amsgrad: must be False (Adagrad has no AMSGrad variant).
        fp32_optimizer_states: accepted for DeepSpeed compatibility; the
            accumulator is fp32 because the parameters are.

    Raises:
        ValueError: amsgrad=True, a parameter that is not fp32 (keep fp32
            parameters, e.g. master weights), or a bad hyperparameter
            (torch's checks).
    """

    def __init__(self, model_params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad: amsgrad=True is not supported (AMSGrad is an Adam variant); "
                             "remove the argument")
        self.fp32_optimizer_states = fp32_optimizer_states
        # Lists, so that the device check below does not consume a generator.
        groups = [dict(g, params=_as_list(g["params"])) if isinstance(g, dict) else g
                  for g in _as_list(model_params)]
        tensors = [t for g in groups for t in (g["params"] if isinstance(g, dict) else [g])]
        tensors = [t[1] if isinstance(t, tuple) else t for t in tensors]  # (name, tensor) pairs
        on_cpu = bool(tensors) and all(t.device.type == "cpu" for t in tensors)
        super().__init__(groups, lr=lr, lr_decay=0, weight_decay=weight_decay, initial_accumulator_value=0,
                         eps=eps, fused=True if on_cpu else None)
        # A hook rather than a step() override: torch wraps each class's step() with the
        # step hooks, so calling Adagrad.step from an override would run them twice.
        self.register_step_pre_hook(_match_grad_strides)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group; raises ValueError (adding nothing) for a parameter that is not fp32."""
        super().add_param_group(param_group)
        bad = [p.dtype for p in self.param_groups[-1]["params"] if p.dtype != torch.float32]
        if bad:
            self.param_groups.pop()
            raise ValueError(f"DeepSpeedCPUAdagrad needs fp32 parameters, got {bad[0]}; keep fp32 "
                             "parameters (master weights) for the optimizer")


def _match_grad_strides(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    # torch's fused Adagrad assumes each gradient has its parameter's strides, as
    # autograd makes it; a gradient set by hand (e.g. contiguous for a transposed
    # parameter) would be read in the wrong order. Copy such a gradient once.
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and not g.is_sparse and g.stride() != p.stride():
                p.grad = torch.empty_like(p).copy_(g)


def _as_list(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)

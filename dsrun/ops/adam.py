"""CPU Adam/AdamW: a SIMD C++ kernel (csrc/cpu_adam/) with a PyTorch fallback.

Two layers:

* `adam_step(...)` and `grad_sq_norm(...)`: functional, on flat contiguous
  CPU tensors (a ZeRO partition). One pass reads the gradient (fp32, bf16 or
  fp16), multiplies it by `grad_scale` (1/loss_scale times the clipping
  coefficient), updates the fp32 parameter and the fp32 moments, and writes
  an optional bf16/fp16 copy of the parameter.
* `CPUAdam`: a torch.optim.Optimizer over fp32 CPU parameters, built on
  `adam_step`.

The native kernel is used when it builds (see dsrun/ops/builder.py);
otherwise the same arithmetic runs in PyTorch, with one line saying why.
See [Note: Adam arithmetic] in csrc/cpu_adam/adam_impl.h for the update.
"""
from __future__ import annotations

import ctypes
import math
import os
from typing import Iterable

import torch

from dsrun.ops.builder import get_op

ISA_NAMES = ("scalar", "avx2", "avx512")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NONE = 3


class _AdamArgs(ctypes.Structure):
    # Mirrors dsrun_adam_args in csrc/cpu_adam/cpu_adam.h.
    _fields_ = [
        ("param", ctypes.c_void_p), ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p), ("exp_avg_sq", ctypes.c_void_p),
        ("param_copy", ctypes.c_void_p), ("n", ctypes.c_int64),
        ("grad_dtype", ctypes.c_int32), ("copy_dtype", ctypes.c_int32),
        ("lr", ctypes.c_float), ("beta1", ctypes.c_float), ("beta2", ctypes.c_float),
        ("eps", ctypes.c_float), ("weight_decay", ctypes.c_float),
        ("step_size", ctypes.c_float), ("bc2_sqrt", ctypes.c_float),
        ("grad_scale", ctypes.c_float), ("adamw_mode", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


def _native():
    lib = get_op("cpu_adam").load()
    if lib is not None and not hasattr(lib, "_dsrun_typed"):
        lib.dsrun_adam_step.argtypes = [ctypes.POINTER(_AdamArgs), ctypes.c_int]
        lib.dsrun_sq_norm.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int32,
                                      ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        lib._dsrun_typed = True
    return lib


def native_available() -> bool:
    """True if the C++ kernel is loaded (False means the PyTorch fallback runs)."""
    return _native() is not None


def selected_isa() -> str | None:
    """Instruction set the kernel runs with: the best this CPU supports, lowered
    by `DSRUN_CPU_ISA=scalar|avx2|avx512` (a higher one than the CPU has is an
    error). None when the fallback runs."""
    lib = _native()
    if lib is None:
        return None
    best = lib.dsrun_cpu_best_isa()
    want = os.environ.get("DSRUN_CPU_ISA")
    if not want:
        return ISA_NAMES[best]
    if want not in ISA_NAMES:
        raise ValueError(f"DSRUN_CPU_ISA={want!r}: expected one of {', '.join(ISA_NAMES)}")
    if ISA_NAMES.index(want) > best:
        raise ValueError(f"DSRUN_CPU_ISA={want}: this CPU supports at most {ISA_NAMES[best]}")
    return want


def _check_flat(name: str, t: torch.Tensor, n: int, dtypes: Iterable[torch.dtype]) -> None:
    dtypes = tuple(dtypes)
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n or t.dtype not in dtypes:
        raise ValueError(
            f"{name}: expected a contiguous CPU tensor of {n} elements with dtype in "
            f"{[str(d) for d in dtypes]}, got {tuple(t.shape)} {t.dtype} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def _threads() -> int:
    return torch.get_num_threads()


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
              weight_decay: float = 0.0, adamw_mode: bool = True, bias_correction: bool = True,
              grad_scale: float = 1.0, param_copy: torch.Tensor | None = None) -> None:
    """One Adam (adamw_mode=False, L2 decay) or AdamW step on flat tensors, in place.

    Args:
        param, exp_avg, exp_avg_sq: fp32 [n], contiguous, CPU; updated in place.
        grad: [n] fp32, bf16 or fp16; read only.
        step: the step number after this update (1 for the first step), for bias correction.
        grad_scale: multiplies the gradient first; pass 1/loss_scale times the
            clipping coefficient (see `unscale_and_clip_coefficient`).
        param_copy: optional [n] bf16 or fp16 tensor receiving the updated parameter.

    Raises:
        ValueError: a tensor has the wrong device, dtype, size or layout, or step < 1.
    """
    n = param.numel()
    _check_flat("param", param, n, [torch.float32])
    _check_flat("grad", grad, n, _DTYPE_CODES)
    _check_flat("exp_avg", exp_avg, n, [torch.float32])
    _check_flat("exp_avg_sq", exp_avg_sq, n, [torch.float32])
    if param_copy is not None:
        _check_flat("param_copy", param_copy, n, [torch.bfloat16, torch.float16])
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count including this update), got {step}")
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step) if bias_correction else 1.0
    lib = _native()
    if n == 0:
        return
    if lib is None:
        _adam_step_torch(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction,
                         grad_scale=grad_scale, param_copy=param_copy)
        return
    args = _AdamArgs(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                     param_copy.data_ptr() if param_copy is not None else None, n,
                     _DTYPE_CODES[grad.dtype], _DTYPE_CODES[param_copy.dtype] if param_copy is not None else _NONE,
                     lr, beta1, beta2, eps, weight_decay, lr / bc1, bc2_sqrt, grad_scale,
                     int(adamw_mode), _threads())
    rc = lib.dsrun_adam_step(ctypes.byref(args), ISA_NAMES.index(selected_isa()))
    if rc != 0:  # arguments were checked above, so this is a bug, not bad input
        raise RuntimeError(f"dsrun_adam_step returned {rc}")


def _adam_step_torch(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                     bias_correction, grad_scale, param_copy) -> None:
    # The PyTorch fallback: the same update as the kernel, all in fp32.
    if grad.dtype != torch.float32 or grad_scale != 1.0:
        grad = grad.float() * grad_scale  # a new tensor: the caller's gradient stays untouched
    if bias_correction:
        # torch's fused CPU Adam does this update in one pass (10x faster than
        # the op-by-op form below); it counts the step itself, hence step - 1.
        from torch.optim.adam import adam as torch_adam
        torch_adam([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step - 1))], fused=True,
                   decoupled_weight_decay=adamw_mode, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                   weight_decay=weight_decay, eps=eps, maximize=False)
    else:
        g = grad.clone()
        if weight_decay and not adamw_mode:
            g.add_(param, alpha=weight_decay)
        if weight_decay and adamw_mode:
            param.mul_(1.0 - lr * weight_decay)
        exp_avg.lerp_(g, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        param.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(eps), value=-lr)
    if param_copy is not None:
        param_copy.copy_(param)


def grad_sq_norm(grad: torch.Tensor) -> float:
    """Sum of squares of a flat CPU tensor (fp32/bf16/fp16), accumulated in fp64.

    Any inf or nan element makes the result inf or nan: that is the overflow
    check. Raises ValueError for a non-contiguous or non-CPU tensor.
    """
    _check_flat("grad", grad, grad.numel(), _DTYPE_CODES)
    lib = _native()
    if lib is None:
        return float(grad.double().square().sum()) if grad.numel() else 0.0
    out = ctypes.c_double(0.0)
    rc = lib.dsrun_sq_norm(grad.data_ptr(), _DTYPE_CODES[grad.dtype], grad.numel(), _threads(),
                           ISA_NAMES.index(selected_isa()), ctypes.byref(out))
    if rc != 0:
        raise RuntimeError(f"dsrun_sq_norm returned {rc}")
    return out.value


def unscale_and_clip_coefficient(sq_norm: float, loss_scale: float = 1.0,
                                 max_norm: float = 0.0) -> tuple[float, float, bool]:
    """Fold loss-scale removal and gradient clipping into one gradient multiplier.

    Args:
        sq_norm: sum of squares of the still-scaled gradients over all ranks.
        loss_scale: the loss scale the gradients carry (1.0 when none).
        max_norm: clip the unscaled global norm to this; 0 disables clipping.

    Returns:
        (grad_scale, unscaled_norm, found_inf): pass grad_scale to
        `adam_step`; skip the step when found_inf.
    """
    norm = math.sqrt(sq_norm) / loss_scale if math.isfinite(sq_norm) else math.inf
    if not math.isfinite(norm):
        return 0.0, norm, True
    scale = 1.0 / loss_scale
    if max_norm > 0 and norm > max_norm:
        scale *= max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s epsilon
    return scale, norm, False


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over fp32 CPU parameters, using the native kernel when built.

    Same results as torch.optim.AdamW (adamw_mode=True) or torch.optim.Adam
    (False) to fp32 rounding. Parameters must be fp32 CPU tensors; gradients
    may be fp32, bf16 or fp16.

    step(closure=None, grad_scale=1.0): grad_scale multiplies every gradient
    first (see `unscale_and_clip_coefficient`).

    Raises:
        ValueError: a parameter that is not an fp32 CPU tensor, or a bad hyperparameter.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, bias_correction: bool = True):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"CPUAdam: invalid hyperparameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay} (need lr, eps, weight_decay >= 0 and 0 <= beta < 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32 or p.device.type != "cpu":
                    raise ValueError(f"CPUAdam needs fp32 CPU parameters, got {p.dtype} on {p.device}; "
                                     "keep fp32 master weights on the CPU and copy to the model")

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                adam_step(p.data.view(-1), p.grad.contiguous().view(-1), state["exp_avg"].view(-1),
                          state["exp_avg_sq"].view(-1), step=int(state["step"]), lr=group["lr"],
                          beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                          adamw_mode=group["adamw_mode"], bias_correction=group["bias_correction"],
                          grad_scale=grad_scale)
        return loss

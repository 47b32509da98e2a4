"""CPU Adam/AdamW: a SIMD C++ kernel (csrc/cpu_adam/) with a PyTorch fallback.

Two layers:

* `adam_step(...)` and `grad_sq_norm(...)`: functional, on flat contiguous
  CPU tensors (a ZeRO partition). One pass reads the gradient (fp32, bf16 or
  fp16), multiplies it by `grad_scale` (1/loss_scale times the clipping
  coefficient), updates the fp32 parameter and the fp32 moments, and writes
  an optional bf16/fp16 copy of the parameter.
* Optimizers (see [Note: native Adam optimizers]): `CPUAdam` over fp32 CPU
  parameters; DeepSpeed's `DeepSpeedCPUAdam` (CPU, fp32/bf16/fp16
  parameters) and `FusedAdam` (CUDA through dsrun.ops.cuda_adam, CPU through
  `adam_step`), with DeepSpeed's signatures. `is_native_adam`,
  `adam_hyperparams`, `adamw_mode` and `bias_correction` let code that owns
  flat partitions run `adam_step` itself with an optimizer's settings.

The native kernel is used when it builds (see dsrun/ops/builder.py);
otherwise the same arithmetic runs in PyTorch, with one line saying why.
See [Note: Adam arithmetic] in csrc/cpu_adam/adam_impl.h for the update.
"""
from __future__ import annotations

import ctypes
import math
from typing import Iterable

import torch

from dsrun.ops import cuda_adam
from dsrun.ops.builder import get_op
from dsrun.ops.isa import ISA_NAMES, choose_isa
from dsrun.ops.optimizer_base import OptimizerBase

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
    return None if lib is None else choose_isa(lib.dsrun_cpu_best_isa())


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


# ---- optimizers ---------------------------------------------------------------

# [Note: native Adam optimizers]
# CPUAdam, DeepSpeedCPUAdam and FusedAdam derive from NativeAdam. Each param
# group holds lr, betas, eps, weight_decay, adamw_mode and bias_correction,
# and each parameter's state is torch's Adam layout: "step" (a 0-dim fp32
# tensor counting applied updates), "exp_avg" and "exp_avg_sq" (fp32, the
# parameter's shape, contiguous). Code that owns flat fp32 partitions (ZeRO)
# may therefore skip `step()` and call `adam_step` itself with
# `adam_hyperparams(group, optimizer)`; `is_native_adam` says when that gives
# the optimizer's own update.

_TORCH_ADAM_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def _check_hyperparams(name: str, lr: float, betas, eps: float, weight_decay: float, amsgrad: bool) -> None:
    if amsgrad:
        raise ValueError(f"{name}: amsgrad=True is not supported (DeepSpeed's {name} has no AMSGrad either); "
                         "use torch.optim.Adam(amsgrad=True), or `torch_adam: true` in ds_config")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas) or lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"{name}: invalid hyperparameters lr={lr} betas={tuple(betas)} eps={eps} "
                         f"weight_decay={weight_decay} (need lr, eps, weight_decay >= 0 and two betas in [0, 1))")


class NativeAdam(OptimizerBase):
    """Base class of dsrun's Adam optimizers; see [Note: native Adam optimizers].

    Not used directly: build CPUAdam, DeepSpeedCPUAdam or FusedAdam. Its
    subclasses share the param-group keys (lr, betas, eps, weight_decay,
    adamw_mode, bias_correction) and the state layout (step, exp_avg,
    exp_avg_sq), and differ only in where `step()` runs.

    Attributes:
        adam_w_mode: the constructor's default adamw_mode (DeepSpeed's name);
            a param group may override it with its own "adamw_mode" key.
    """

    def __init__(self, params, defaults: dict) -> None:
        super().__init__(params, defaults)
        self.adam_w_mode = bool(defaults["adamw_mode"])

    def __setstate__(self, state: dict) -> None:
        # A state dict saved by another Adam (torch's, DeepSpeed's) may lack dsrun's group keys.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", self.defaults["adamw_mode"])
            group.setdefault("bias_correction", self.defaults["bias_correction"])

    def _init_state(self, p: torch.Tensor, keep_master: bool) -> dict:
        """This parameter's state, created on its first step (fp32 moments on p's device)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            if keep_master and p.dtype != torch.float32:
                state["master_param"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format,
                                                      copy=True)
        return state


def is_native_adam(optimizer: torch.optim.Optimizer) -> bool:
    """True when `adam_step` reproduces `optimizer`'s update, group by group.

    True for dsrun's CPUAdam, DeepSpeedCPUAdam and FusedAdam, and for plain
    torch.optim.Adam / AdamW (exactly those classes, not subclasses) whose
    groups all have amsgrad, maximize, capturable and differentiable off.
    Read each group's hyperparameters with `adam_hyperparams(group,
    optimizer)`: lr, betas, eps and weight_decay come from `group["lr"]`,
    `group["betas"]`, `group["eps"]`, `group["weight_decay"]` (floats or
    0-dim tensors), the rest from `adamw_mode(group, optimizer)` and
    `bias_correction(group)`. All of them keep the per-parameter state
    `optimizer.state[p]` as step (0-dim tensor), exp_avg and exp_avg_sq
    (p's shape; fp32 for fp32 parameters, and always fp32 in dsrun's classes).
    """
    if isinstance(optimizer, NativeAdam):
        return True
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(group.get(flag, False) for group in optimizer.param_groups for flag in _TORCH_ADAM_FLAGS)


def adamw_mode(group: dict, optimizer: torch.optim.Optimizer) -> bool:
    """True when `group` of `optimizer` decays weights decoupled (AdamW), False for L2 (Adam).

    Raises:
        TypeError: `optimizer` is neither a dsrun Adam nor a torch.optim.Adam/AdamW.
    """
    if isinstance(optimizer, NativeAdam):
        return bool(group.get("adamw_mode", optimizer.adam_w_mode))
    if isinstance(optimizer, torch.optim.AdamW):
        return True
    if isinstance(optimizer, torch.optim.Adam):
        return bool(group.get("decoupled_weight_decay", False))
    raise TypeError(f"adamw_mode: {type(optimizer).__name__} is not an Adam optimizer")


def bias_correction(group: dict) -> bool:
    """Whether `group` applies Adam's bias correction (True unless the group says otherwise)."""
    return bool(group.get("bias_correction", True))


def adam_hyperparams(group: dict, optimizer: torch.optim.Optimizer) -> dict:
    """`group`'s hyperparameters as keyword arguments of `adam_step` (plain Python values).

    Returns:
        dict with lr, beta1, beta2, eps, weight_decay (float), adamw_mode and
        bias_correction (bool); pass `step=` and the tensors yourself.

    Raises:
        TypeError: `optimizer` is not an Adam (see `adamw_mode`).
    """
    beta1, beta2 = group["betas"]
    return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), adamw_mode=adamw_mode(group, optimizer),
                bias_correction=bias_correction(group))


def _step_cpu_param(p: torch.Tensor, state: dict, hyper: dict, grad_scale: float) -> None:
    """One `adam_step` on a CPU parameter of any shape and layout.

    fp32 p is updated in place. A 16-bit p is updated from state["master_param"]
    (fp32) when the state has one, else from a temporary fp32 copy of p; either
    way p receives the new value rounded to its dtype.
    """
    if p.grad.is_sparse:
        raise ValueError("dsrun's Adam does not support sparse gradients; use torch.optim.SparseAdam")
    grad = p.grad.contiguous().view(-1)
    data = p.detach()
    state["step"] += 1
    step = int(state["step"])
    moments = (state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
    if p.dtype == torch.float32:
        work = data if data.is_contiguous() else data.contiguous()
        adam_step(work.view(-1), grad, *moments, step=step, grad_scale=grad_scale, **hyper)
        if work is not data:
            data.copy_(work)
        return
    master = state.get("master_param")
    work = master if master is not None else data.to(torch.float32, memory_format=torch.contiguous_format)
    if data.is_contiguous() and data.dtype in (torch.bfloat16, torch.float16):
        adam_step(work.view(-1), grad, *moments, step=step, grad_scale=grad_scale, param_copy=data.view(-1),
                  **hyper)
    else:
        adam_step(work.view(-1), grad, *moments, step=step, grad_scale=grad_scale, **hyper)
        data.copy_(work)


class CPUAdam(NativeAdam):
    """Adam/AdamW over fp32 CPU parameters, using the native kernel when built.

    Same results as torch.optim.AdamW (adamw_mode=True) or torch.optim.Adam
    (False) to fp32 rounding. Parameters must be fp32 CPU tensors (any shape);
    gradients may be fp32, bf16 or fp16. bias_correction=False drops Adam's
    1/(1 - beta^t) factors.

    step(closure=None, grad_scale=1.0): grad_scale multiplies every gradient
    first (see `unscale_and_clip_coefficient`); returns closure's loss.

    Raises:
        ValueError: a parameter that is not an fp32 CPU tensor, a bad
            hyperparameter, or (at step) a sparse gradient.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, bias_correction: bool = True):
        _check_hyperparams(type(self).__name__, lr, betas, eps, weight_decay, amsgrad=False)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, then a check of the new group's parameters (see Raises)."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._check_param(p)

    def _check_param(self, p: torch.Tensor) -> None:
        if p.dtype != torch.float32 or p.device.type != "cpu":
            raise ValueError(f"CPUAdam needs fp32 CPU parameters, got {p.dtype} on {p.device}; keep fp32 "
                             "master weights on the CPU and copy to the model (or use DeepSpeedCPUAdam)")

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        loss = self.closure_loss(closure)
        for group in self.param_groups:
            hyper = adam_hyperparams(group, self)
            for p in group["params"]:
                if p.grad is not None:
                    _step_cpu_param(p, self._init_state(p, keep_master=True), hyper, grad_scale)
        return loss


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's `deepspeed.ops.adam.DeepSpeedCPUAdam`, on dsrun's CPU kernel.

    Adam (adamw_mode=False: L2 weight decay) or AdamW over CPU parameters of
    any shape in fp32, bf16 or fp16, with fp32 moments. For a 16-bit
    parameter the optimizer keeps an fp32 copy in its state
    ("master_param"), steps that copy and writes it back rounded to the
    parameter's dtype, so small updates are not lost to rounding. That copy
    is the source of truth: a value written into the 16-bit parameter from
    outside the optimizer is overwritten at its next step (load the
    optimizer's state dict along with the model).

    Args:
        model_params: parameters or parameter-group dicts (CPU tensors).
        lr, betas, eps, weight_decay: as torch.optim.Adam (defaults 1e-3,
            (0.9, 0.999), 1e-8, 0).
        bias_correction: apply Adam's bias correction (default True).
        amsgrad: must be False.
        adamw_mode: True (default) for decoupled weight decay (AdamW).
        fp32_optimizer_states: must be True for 16-bit parameters (the kernel
            keeps fp32 moments only); for fp32 parameters both values mean the same.

    Raises:
        ValueError: amsgrad=True, a parameter not on the CPU or not
            fp32/bf16/fp16, 16-bit parameters with fp32_optimizer_states=False,
            or a bad hyperparameter.
    """

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        _check_hyperparams("DeepSpeedCPUAdam", lr, betas, eps, weight_decay, amsgrad)
        self.fp32_optimizer_states = fp32_optimizer_states  # read by _check_param during construction
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw_mode=adamw_mode, bias_correction=bias_correction)

    def _check_param(self, p: torch.Tensor) -> None:
        if p.dtype not in _DTYPE_CODES or p.device.type != "cpu":
            raise ValueError(f"DeepSpeedCPUAdam needs CPU parameters in fp32, bf16 or fp16, got {p.dtype} on "
                             f"{p.device}; use FusedAdam for GPU parameters")
        if p.dtype != torch.float32 and not self.fp32_optimizer_states:
            raise ValueError(f"DeepSpeedCPUAdam(fp32_optimizer_states=False): dsrun keeps Adam moments in fp32 "
                             f"only, got a {p.dtype} parameter; drop the argument (fp32 states) or use fp32 "
                             "parameters")


class FusedAdam(NativeAdam):
    """DeepSpeed's `deepspeed.ops.adam.FusedAdam`: Adam/AdamW on any device.

    CUDA parameters are stepped by `dsrun.ops.cuda_adam.multi_tensor_adam`
    (a few kernel launches per dtype; PyTorch arithmetic when the kernel is
    not built), CPU parameters by `adam_step` (the native CPU kernel).
    Parameters of any shape in fp32, bf16 or fp16; moments are fp32 and the
    arithmetic is fp32. As in DeepSpeed, a 16-bit parameter is its own
    master copy: each step computes in fp32 and rounds the result back into
    the parameter. Results equal torch.optim.AdamW (adam_w_mode=True) or
    torch.optim.Adam (False, L2 decay) to fp32 rounding.

    Args:
        params: parameters or parameter-group dicts.
        lr, betas, eps, weight_decay: as torch.optim.Adam (defaults 1e-3,
            (0.9, 0.999), 1e-8, 0).
        bias_correction: apply Adam's bias correction (default True).
        adam_w_mode: True (default) for decoupled weight decay (AdamW).
        amsgrad: must be False.
        set_grad_none: `zero_grad()` sets gradients to None (default True)
            rather than zeroing them.

    step(closure=None, grad_scale=1.0): grad_scale multiplies every gradient
    first; returns closure's loss.

    Raises:
        ValueError: amsgrad=True or a bad hyperparameter; at step, a sparse
            gradient or a dtype other than fp32/bf16/fp16.
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        _check_hyperparams("FusedAdam", lr, betas, eps, weight_decay, amsgrad)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adam_w_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients: to None when `set_to_none` (default: `set_grad_none`), else to zeros."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @staticmethod
    def _on_cpu(p: torch.Tensor) -> bool:
        # One routing decision per parameter; the tests override it to run the
        # multi-tensor path on CPU tensors (its PyTorch fallback).
        return p.device.type == "cpu"

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        loss = self.closure_loss(closure)
        for group in self.param_groups:
            hyper = adam_hyperparams(group, self)
            # (device, dtype, step) -> [(param, work param, grad, exp_avg, exp_avg_sq)]
            batches: dict[tuple, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype not in _DTYPE_CODES:
                    raise ValueError(f"FusedAdam supports fp32, bf16 and fp16 parameters, got {p.dtype}")
                state = self._init_state(p, keep_master=False)
                if self._on_cpu(p):
                    _step_cpu_param(p, state, hyper, grad_scale)
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FusedAdam does not support sparse gradients; use torch.optim.SparseAdam")
                state["step"] += 1
                data = p.detach()
                work = data if data.is_contiguous() else data.contiguous()
                grad = p.grad.to(p.dtype, memory_format=torch.contiguous_format)
                key = (p.device, p.dtype, int(state["step"]))
                batches.setdefault(key, []).append((data, work, grad, state["exp_avg"], state["exp_avg_sq"]))
            for (_, _, step), items in batches.items():
                datas, works, grads, exp_avgs, exp_avg_sqs = (list(col) for col in zip(*items))
                cuda_adam.multi_tensor_adam(works, grads, exp_avgs, exp_avg_sqs, step=step, grad_scale=grad_scale,
                                            **hyper)
                for data, work in zip(datas, works):
                    if work is not data:  # a non-contiguous parameter was stepped on a contiguous copy
                        data.copy_(work)
        return loss

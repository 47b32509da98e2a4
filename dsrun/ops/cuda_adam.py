"""Fused multi-tensor Adam/AdamW on CUDA (csrc/cuda_adam/), with a PyTorch fallback.

`multi_tensor_adam` updates lists of CUDA tensors in a few kernel launches
(up to 36 tensors / 320 blocks of 8192 elements each): parameters and
gradients fp32, bf16 or fp16 (the same dtype), moments fp32, fp32 math.
Without a CUDA build of torch (or a GPU) the native op is unavailable and the
same arithmetic runs per tensor in PyTorch.
"""
from __future__ import annotations

import ctypes
import math

import torch

from dsrun.ops.builder import get_op

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _native():
    lib = get_op("cuda_adam").load()
    if lib is not None and not hasattr(lib, "_dsrun_typed"):
        f = lib.dsrun_cuda_multi_tensor_adam
        ptrs = ctypes.POINTER(ctypes.c_void_p)
        f.argtypes = [ctypes.c_int, ptrs, ptrs, ptrs, ptrs, ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
                      ctypes.c_int, *[ctypes.c_float] * 8, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib._dsrun_typed = True
    return lib


def native_available() -> bool:
    """True if the CUDA kernel is built and loaded."""
    return _native() is not None


def multi_tensor_adam(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float = 0.9,
                      beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                      bias_correction: bool = True, grad_scale: float = 1.0,
                      found_inf: torch.Tensor | None = None) -> None:
    """One Adam/AdamW step over lists of tensors, in place.

    Args:
        params, grads: same-shape contiguous tensors of one dtype (fp32/bf16/fp16).
        exp_avgs, exp_avg_sqs: fp32 contiguous tensors shaped like params.
        step: step count including this update (>= 1).
        bias_correction: False drops Adam's 1/(1 - beta^step) factors from
            both moments (DeepSpeed's `bias_correction: false`).
        grad_scale: multiplies every gradient (1/loss_scale x clip coefficient).
        found_inf: optional one-element fp32 tensor on the device; non-zero
            skips the update without a host synchronisation.

    Raises:
        ValueError: mismatched lists, shapes, dtypes, devices or layouts, or step < 1.
    """
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)):
        raise ValueError("multi_tensor_adam: params, grads, exp_avgs and exp_avg_sqs must have the same length")
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if (p.dtype not in _DTYPES or g.dtype != p.dtype or m.dtype != torch.float32 or v.dtype != torch.float32
                or not all(t.is_contiguous() and t.shape == p.shape and t.device == p.device for t in (g, m, v))):
            raise ValueError(f"multi_tensor_adam: tensor {i}: need contiguous same-shape tensors on one device, "
                             f"params/grads of one dtype in fp32/bf16/fp16 and fp32 moments; got {p.dtype}/"
                             f"{g.dtype}/{m.dtype}/{v.dtype} shapes {tuple(p.shape)}/{tuple(g.shape)}")
    step_size = lr / (1.0 - beta1 ** step) if bias_correction else lr
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step) if bias_correction else 1.0
    lib = _native() if params and params[0].is_cuda else None
    if lib is None:
        _fallback(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                  step_size, bc2_sqrt, grad_scale, found_inf)
        return
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    stream = torch.cuda.current_stream(params[0].device).cuda_stream
    for dtype, idx in by_dtype.items():
        n = len(idx)
        arr = lambda ts: (ctypes.c_void_p * n)(*[ts[i].data_ptr() for i in idx])  # noqa: E731
        sizes = (ctypes.c_int64 * n)(*[params[i].numel() for i in idx])
        rc = lib.dsrun_cuda_multi_tensor_adam(
            n, arr(params), arr(grads), arr(exp_avgs), arr(exp_avg_sqs), sizes, _DTYPES[dtype], _DTYPES[dtype],
            lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt, grad_scale, int(adamw_mode),
            found_inf.data_ptr() if found_inf is not None else None, stream)
        if rc != 0:
            raise RuntimeError(f"dsrun_cuda_multi_tensor_adam failed with cudaError {rc}")


def _fallback(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, adamw_mode, step_size,
              bc2_sqrt, grad_scale, found_inf) -> None:
    if found_inf is not None and float(found_inf) != 0.0:
        return
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32 = p.float()
        g32 = g.float() * grad_scale
        if weight_decay and not adamw_mode:
            g32.add_(p32, alpha=weight_decay)
        if weight_decay and adamw_mode:
            p32.mul_(1.0 - lr * weight_decay)
        m.lerp_(g32, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g32, g32, value=1.0 - beta2)
        p32.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps), value=-step_size)
        p.copy_(p32)

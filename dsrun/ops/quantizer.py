"""Compression kernels (csrc/quantizer/): block quantization (int8, int4) for
ZeRO++ and sign packing for the 1-bit optimizers, on CPU (scalar, AVX2 or
AVX-512, chosen at run time like the CPU Adam: `DSRUN_CPU_ISA` lowers it) and
on CUDA.

These are the native paths of dsrun/runtime/comm/quantized.py and
compressed.py, which hold the PyTorch code the kernels reproduce bit for bit
(see [Note: quantizer arithmetic] in csrc/quantizer/quant_impl.h). Every
function here returns None when it has no kernel for its inputs (the op is not
built, a device without one, a dtype other than fp32/bf16/fp16): the caller
then runs its PyTorch code. The kernels trust their arguments; the callers
pass contiguous tensors of the documented shapes.
"""
from __future__ import annotations

import ctypes

import torch

from dsrun.ops.builder import get_op
from dsrun.ops.isa import ISA_NAMES, choose_isa

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I32, _I64, _INT = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {  # C argument types after which the CPU library takes (threads, isa), the CUDA one (stream)
    "quantize": [_P, _I32, _I64, _I64, _I32, _P, _P],
    "dequantize": [_P, _P, _I64, _I32, _I64, _I32, _P],
    "sign_pack": [_P, _I32, _I64, _P],
    "sign_unpack": [_P, _P, _I64, _I64, _I32, _P],
    "onebit_compress": [_P, _I64, _I64, _P, _P, _P, _P, _I64],
}


def _typed(lib: ctypes.CDLL, prefix: str, tail: list) -> ctypes.CDLL:
    if not hasattr(lib, "_dsrun_typed"):
        for name, args in _SIGNATURES.items():
            getattr(lib, f"{prefix}{name}").argtypes = args + tail
        lib._dsrun_typed = True
    return lib


def _cpu() -> ctypes.CDLL | None:
    lib = get_op("quantizer").load()
    return None if lib is None else _typed(lib, "dsrun_", [_I32, _INT])


def _cuda() -> ctypes.CDLL | None:
    lib = get_op("quantizer_cuda").load()
    return None if lib is None else _typed(lib, "dsrun_cuda_", [_P])


def native_available(device: str | torch.device = "cpu") -> bool:
    """True if the kernels for `device` ("cpu" or "cuda") are built and loaded."""
    return (_cuda() if torch.device(device).type == "cuda" else _cpu()) is not None


def selected_isa() -> str | None:
    """Instruction set of the CPU kernels (see dsrun.ops.isa.choose_isa); None when they are not loaded."""
    lib = _cpu()
    return None if lib is None else choose_isa(lib.dsrun_quant_best_isa())


def _kernel(name: str, device: torch.device):
    """Kernel `name` for tensors on `device`, called with its C arguments; None
    when there is none (the caller falls back). Raises RuntimeError when the
    kernel fails: the callers checked the arguments, so that is a bug or a
    CUDA error."""
    if device.type == "cpu":
        lib = _cpu()
        tail = lambda: (torch.get_num_threads(), ISA_NAMES.index(selected_isa()))  # noqa: E731
        prefix = "dsrun_"
    elif device.type == "cuda":
        lib = _cuda()
        tail = lambda: (torch.cuda.current_stream(device).cuda_stream,)  # noqa: E731
        prefix = "dsrun_cuda_"
    else:
        return None
    if lib is None:
        return None
    fn = getattr(lib, prefix + name)

    def run(*args) -> None:
        rc = fn(*args, *tail())
        if rc != 0:
            raise RuntimeError(f"{prefix}{name} failed with status {rc}")
    return run


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quantize(x: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Block quantization of `x` (any shape, fp32/bf16/fp16, read flat).

    Returns (q, scales): bits 8, q int8 [blocks·block]; bits 4, q uint8
    [blocks·block/2]; scales fp32 [blocks], blocks = ceil(numel/block). None
    when no kernel applies. The format is comm/quantized.py's.
    """
    run = _kernel("quantize", x.device)
    if run is None or x.dtype not in _DTYPES:
        return None
    x = x.reshape(-1).contiguous()
    blocks = -(-x.numel() // block)
    q = torch.empty(blocks * block * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    run(_ptr(x), _DTYPES[x.dtype], x.numel(), block, bits, _ptr(q), _ptr(scales))
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int, bits: int, n: int,
               dtype: torch.dtype) -> torch.Tensor | None:
    """The first n values of `quantize`'s output as `dtype` [n] (fp32/bf16/fp16), or None."""
    run = _kernel("dequantize", q.device)
    if (run is None or dtype not in _DTYPES or q.dtype != (torch.int8 if bits == 8 else torch.uint8)
            or scales.dtype != torch.float32 or scales.device != q.device):
        return None
    q, scales = q.contiguous(), scales.contiguous()
    out = torch.empty(n, dtype=dtype, device=q.device)
    run(_ptr(q), _ptr(scales), block, bits, n, _DTYPES[dtype], _ptr(out))
    return out


def sign_pack(x: torch.Tensor) -> torch.Tensor | None:
    """Sign bits of a 1-D fp32/bf16/fp16 `x` (numel a multiple of 8): uint8 [numel/8], or None."""
    run = _kernel("sign_pack", x.device)
    if run is None or x.dtype not in _DTYPES:
        return None
    x = x.contiguous()
    out = torch.empty(x.numel() // 8, dtype=torch.uint8, device=x.device)
    run(_ptr(x), _DTYPES[x.dtype], x.numel(), _ptr(out))
    return out


def sign_unpack(packed: torch.Tensor, dtype: torch.dtype, n: int, scales: torch.Tensor | None = None,
                chunk: int = 0, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """±1 (times scales[i // chunk] when scales is given) for the first n bits of
    `packed` (uint8), as `dtype` [n] (fp32/bf16/fp16), written into `out`
    when given (contiguous, n elements). chunk: a multiple of 8. None when no
    kernel applies."""
    run = _kernel("sign_unpack", packed.device)
    if run is None or dtype not in _DTYPES or packed.dtype != torch.uint8:
        return None
    if scales is None:
        chunk = max(8, -(-n // 8) * 8)
    else:
        scales = scales.contiguous()
    if out is None:
        out = torch.empty(n, dtype=dtype, device=packed.device)
    packed = packed.contiguous()  # held here: a temporary's memory could be reused before the kernel runs
    run(_ptr(packed), _ptr(scales), chunk, n, _DTYPES[dtype], _ptr(out))
    return out


def onebit_compress(y: torch.Tensor, real: list[int], scales: torch.Tensor, error: torch.Tensor) -> torch.Tensor | None:
    """Sign bits and error feedback of 1-bit compression, one pass.

    y: fp32 [chunks, width] contiguous, width a multiple of 8, zero beyond
    real[k] in row k; scales: fp32 [chunks]. Writes error (fp32, contiguous,
    at most chunks·width elements) = the first error.numel() values of
    y - scale·sign(y), 0 on padding. Returns the packed signs, uint8
    [chunks·width/8], or None when no kernel applies.
    """
    run = _kernel("onebit_compress", y.device)
    if (run is None or y.dtype != torch.float32 or not y.is_contiguous() or error.dtype != torch.float32
            or not error.is_contiguous() or error.device != y.device or error.numel() > y.numel()):
        return None
    chunks, width = y.shape
    real_t = torch.tensor(real, dtype=torch.int64, device=y.device)
    packed = torch.empty(chunks * width // 8, dtype=torch.uint8, device=y.device)
    scales = scales.contiguous()
    run(_ptr(y), chunks, width, _ptr(real_t), _ptr(scales), _ptr(packed), _ptr(error), error.numel())
    return packed

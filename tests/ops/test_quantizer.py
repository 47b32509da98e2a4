"""Compression kernels (dsrun.ops.quantizer) against the PyTorch code of
comm/quantized.py and comm/compressed.py, bit for bit, on every instruction
set this CPU has; the CUDA build is compile-checked with nvcc."""
from __future__ import annotations

import subprocess

import pytest
import torch

from dsrun.ops import quantizer
from dsrun.ops.builder import csrc_dir, get_op
from dsrun.ops.isa import ISA_NAMES
from dsrun.runtime.comm import compressed, quantized

from tests.ops.test_cuda_adam import _nvcc

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Lengths straddle the vector widths (8, 16), a block, and the work item of 65536 elements.
SIZES = [1, 7, 17, 255, 4099, 2 * 65536 + 13]


@pytest.fixture(scope="module", autouse=True)
def native_loaded():
    # These tests mean to test the C++ kernels: they must have been built.
    assert get_op("quantizer").load() is not None, f"quantizer did not build: {get_op('quantizer').reason}"


def _best() -> str:
    flags = open("/proc/cpuinfo").read()
    return "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags and " f16c" in flags else "scalar"


def test_best_isa_on_this_cpu(monkeypatch):
    monkeypatch.delenv("DSRUN_CPU_ISA", raising=False)
    assert quantizer.selected_isa() == _best()


@pytest.fixture(params=ISA_NAMES)
def isa(request, monkeypatch):
    if ISA_NAMES.index(request.param) > ISA_NAMES.index(_best()):
        pytest.skip(f"this CPU has no {request.param} (best: {_best()})")
    monkeypatch.setenv("DSRUN_CPU_ISA", request.param)
    assert quantizer.selected_isa() == request.param
    return request.param


def same(a: torch.Tensor, b: torch.Tensor, nan_bits: bool = False) -> None:
    """Equal dtype, shape and bits, except that any nan equals any nan (torch's
    own nan payload in a conversion depends on which of its loops ran), unless
    `nan_bits` (scales: they travel as bytes, so their nans must match too)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if nan_bits:
        a, b = a.view(torch.int32), b.view(torch.int32)
    elif a.dtype.is_floating_point:
        assert torch.equal(a.isnan(), b.isnan())
        a, b = a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        a, b = a.view(bits), b.view(bits)
    assert torch.equal(a, b), (a != b).nonzero()[:8].flatten().tolist()


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over 10 decades and, when n > 64: inf, -inf, nan, -0.0, an all-zero
    block and a block so small that its scale underflows (the 1e-38 floor)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-5, 5, n)
    if n > 64:
        x[40:56] = 0.0
        x[56:64] = 1e-44
        x[3], x[n // 2], x[n - 2], x[9], x[10] = float("inf"), float("nan"), float("-inf"), -0.0, -3e38
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_int8_matches_torch(isa, dtype, n):
    x = _values(n, dtype, n)
    for block in (1, 3, 16, 256) if n < 5000 else (256, 65536 + 3):  # the last: one block per work item
        got = quantizer.quantize(x, block, bits=8)
        want = quantized._quantize_torch(x, block)
        same(got[0], want[0])
        same(got[1], want[1], nan_bits=True)
        for out in DTYPES:
            same(quantizer.dequantize(*want, block, 8, want[0].numel(), out), quantized._dequantize_torch(*want, out))
        # unpack_message decodes only the n real values
        same(quantizer.dequantize(*want, block, 8, n, torch.float32), quantized._dequantize_torch(*want, torch.float32)[:n])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_int4_matches_torch(isa, dtype, n):
    x = _values(n, dtype, n + 1)
    for block in (2, 16, 34, 256) if n < 5000 else (256, 65536 + 2):
        got = quantizer.quantize(x, block, bits=4)
        want = quantized._quantize_int4_torch(x, block)
        same(got[0], want[0])
        same(got[1], want[1], nan_bits=True)
        for out in DTYPES:
            same(quantizer.dequantize(*want, block, 4, 2 * want[0].numel(), out),
                 quantized._dequantize_int4_torch(*want, out))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [8, 24, 4096 + 8, 2 * 65536 + 40])
def test_sign_pack_unpack_match_torch(isa, dtype, n):
    x = _values(n, dtype, n)
    same(quantizer.sign_pack(x), compressed._pack_signs_torch(x))
    packed = compressed._pack_signs_torch(x)
    for out in DTYPES:
        same(quantizer.sign_unpack(packed, out, n), compressed._unpack_signs_torch(packed, out))
    scales = torch.tensor([0.5, float("inf"), 0.0, float("nan"), 3e-39])
    chunk = -(-n // (8 * scales.numel())) * 8
    pad = torch.zeros(chunk * scales.numel() // 8, dtype=torch.uint8)
    pad[:packed.numel()] = packed
    want = compressed._unpack_signs_torch(pad).view(-1, chunk).mul_(scales.unsqueeze(1)).view(-1)[:n - 3]
    same(quantizer.sign_unpack(pad, torch.float32, n - 3, scales, chunk), want)


@pytest.mark.parametrize("chunks, width, real", [(1, 8, [5]), (2, 24, [24, 0]), (3, 4096, [4096, 4000, 17]),
                                                 (2, 65536 + 64, [65536 + 64, 65536 + 1])])
def test_onebit_compress_matches_torch(isa, chunks, width, real, monkeypatch):
    gen = torch.Generator().manual_seed(width)
    y = torch.randn(chunks, width, generator=gen)
    y.view(-1)[[0, 2, 3]] = torch.tensor([float("nan"), -0.0, float("inf")])
    scales = compressed._chunk_scales(y, real)
    for n_error in (chunks * width, chunks * width - 5, sum(real)):
        e_native = torch.full((n_error,), 7.0)
        got = compressed._signs_and_error(y, real, scales, e_native)
        e_torch = torch.full((n_error,), 7.0)
        with monkeypatch.context() as m:
            m.setattr(quantizer, "_cpu", lambda: None)
            want = compressed._signs_and_error(y, real, scales, e_torch)
        same(got, want)
        same(e_native, e_torch)


def test_public_functions_use_the_kernel_and_fall_back(monkeypatch):
    calls = []
    kernel = quantizer._kernel
    monkeypatch.setattr(quantizer, "_kernel", lambda name, dev: calls.append(name) or kernel(name, dev))
    x = _values(1000, torch.bfloat16, 0)
    message = quantized.pack_message(x, 256)
    native = quantized.unpack_message(message, 1000, 256, torch.float32)
    codes, scales = quantized.quantize_int4(x, 64)
    native4 = quantized.dequantize_int4(codes, scales)
    signs = compressed.pack_signs(x[:992])
    assert calls == ["quantize", "dequantize", "quantize", "dequantize", "sign_pack"]
    monkeypatch.setattr(quantizer, "_cpu", lambda: None)  # the op not built: the PyTorch code runs
    same(quantized.pack_message(x, 256), message)
    same(quantized.unpack_message(message, 1000, 256, torch.float32), native)
    same(quantized.quantize_int4(x, 64)[0], codes)
    same(quantized.dequantize_int4(codes, scales), native4)
    same(compressed.pack_signs(x[:992]), signs)
    # A dtype without a kernel (fp64) takes the PyTorch code too.
    same(quantized.quantize_blockwise(x.double(), 256)[0], message[:1024])


def test_isa_override_validation(monkeypatch):
    monkeypatch.setenv("DSRUN_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="expected one of"):
        quantizer.selected_isa()


def test_cuda_kernels_compile_with_nvcc(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH): cannot compile-check the CUDA kernels")
    obj = tmp_path / "quantizer_cuda.o"
    proc = subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_80", "-Xcompiler", "-fPIC", "-c",
                           str(csrc_dir() / "quantizer" / "quantizer_cuda.cu"), "-o", str(obj)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    symbols = subprocess.run(["nm", str(obj)], capture_output=True, text=True).stdout
    for name in ("quantize", "dequantize", "sign_pack", "sign_unpack", "onebit_compress"):
        assert f" T dsrun_cuda_{name}" in symbols, name


def test_cuda_op_unavailable_reason_on_cpu_torch():
    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    assert not quantizer.native_available("cuda")
    assert "CPU build" in get_op("quantizer_cuda").reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the CUDA kernels are compiled, untested on a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_torch(dtype):
    assert quantizer.native_available("cuda"), get_op("quantizer_cuda").reason
    for n in (17, 4099, 2 * 65536 + 13):
        x = _values(n, dtype, n)
        for block, bits in ((3, 8), (256, 8), (34, 4), (256, 4)):
            ref = quantized._quantize_torch if bits == 8 else quantized._quantize_int4_torch
            want = ref(x, block)
            got = quantizer.quantize(x.cuda(), block, bits)
            same(got[0].cpu(), want[0])
            same(got[1].cpu(), want[1])
            deq = quantized._dequantize_torch if bits == 8 else quantized._dequantize_int4_torch
            count = want[0].numel() * 8 // bits
            same(quantizer.dequantize(got[0], got[1], block, bits, count, dtype).cpu(), deq(*want, dtype))
        m = n - n % 8
        same(quantizer.sign_pack(x[:m].cuda()).cpu(), compressed._pack_signs_torch(x[:m]))
        packed = compressed._pack_signs_torch(x[:m])
        same(quantizer.sign_unpack(packed.cuda(), dtype, m).cpu(), compressed._unpack_signs_torch(packed, dtype))
    y = torch.randn(2, 4096)
    scales = compressed._chunk_scales(y, [4096, 4000])
    e_gpu, e_cpu = torch.empty(8000, device="cuda"), torch.empty(8000)
    packed = quantizer.onebit_compress(y.cuda(), [4096, 4000], scales.cuda(), e_gpu)
    same(packed.cpu(), compressed._signs_and_error(y, [4096, 4000], scales, e_cpu))
    same(e_gpu.cpu(), e_cpu)

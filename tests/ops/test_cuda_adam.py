"""Fused multi-tensor CUDA Adam: nvcc compile check here, numerics where a GPU exists."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dsrun.ops import cuda_adam
from dsrun.ops.builder import csrc_dir, get_op


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") or (str(Path(home) / "bin" / "nvcc") if (Path(home) / "bin" / "nvcc").exists() else None)


def test_kernel_compiles_with_nvcc(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH): cannot compile-check the CUDA kernel")
    obj = tmp_path / "mta.o"
    proc = subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_80", "-Xcompiler", "-fPIC", "-c",
                           str(csrc_dir() / "cuda_adam" / "multi_tensor_adam.cu"), "-o", str(obj)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    symbols = subprocess.run(["nm", str(obj)], capture_output=True, text=True).stdout
    assert " T dsrun_cuda_multi_tensor_adam" in symbols


def test_unavailable_reason_on_cpu_torch():
    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    assert not cuda_adam.native_available()
    assert "CPU build" in get_op("cuda_adam").reason


def _compare(device: str, dtype: torch.dtype, sizes: list[int], adamw: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    p0 = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    gs = [[torch.randn(n, generator=gen).to(dtype) for n in sizes] for _ in range(3)]
    params = [p.clone().to(device) for p in p0]
    m = [torch.zeros(n, device=device) for n in sizes]
    v = [torch.zeros(n, device=device) for n in sizes]
    ref = [p.float().clone().requires_grad_() for p in p0]
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for step, g in enumerate(gs, start=1):
        cuda_adam.multi_tensor_adam(params, [x.to(device) for x in g], m, v, step=step, lr=1e-2, weight_decay=0.1,
                                    adamw_mode=adamw, grad_scale=0.5)
        for r, x in zip(ref, g):
            r.grad = x.float() * 0.5
        opt.step()
        for r in ref:  # the 16-bit parameter is what the next step starts from
            r.data.copy_(r.data.to(dtype).float())
    tol = dict(rtol=1e-5, atol=3e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.cpu().float(), r.detach(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fallback_matches_torch(dtype):
    _compare("cpu", dtype, [0, 5, 1000], adamw=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the CUDA kernel is compiled, untested on a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw", [True, False])
def test_native_matches_torch_on_gpu(dtype, adamw):
    assert cuda_adam.native_available(), get_op("cuda_adam").reason
    # 40 tensors (> 36 per launch) and one of 3M elements (> 320 blocks per launch).
    _compare("cuda", dtype, [0, 1, 8191, 8193] + [97 * i for i in range(1, 36)] + [3_000_001], adamw)
    p = [torch.ones(10, device="cuda")]
    cuda_adam.multi_tensor_adam(p, [torch.ones(10, device="cuda")], [torch.zeros(10, device="cuda")],
                                [torch.zeros(10, device="cuda")], step=1, lr=1.0,
                                found_inf=torch.ones(1, device="cuda"))
    assert torch.equal(p[0], torch.ones(10, device="cuda"))  # found_inf skipped the update

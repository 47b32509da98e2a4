"""CPU Adam (dsrun.ops.adam) against torch.optim.Adam/AdamW, native and fallback."""
from __future__ import annotations

import math

import pytest
import torch

from dsrun.ops import adam
from dsrun.ops.builder import get_op

# Sizes straddle the vector widths (8, 16), the OpenMP chunk (65536) and zero.
SIZES = [0, 1, 17, 2 * 65536 + 13]
# Gradient dtype x copy dtype: each value of each appears at least once.
DTYPES = [(torch.float32, None), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
          (torch.float16, torch.bfloat16), (torch.float16, None)]
STEPS = 3


def _isas() -> list[str]:
    best = adam.selected_isa()
    return list(adam.ISA_NAMES[: adam.ISA_NAMES.index(best) + 1]) if best else []


@pytest.fixture(scope="module", autouse=True)
def native_loaded():
    # The tests below mean to test the C++ kernel: it must have been built.
    lib = get_op("cpu_adam").load()
    assert lib is not None, f"cpu_adam did not build: {get_op('cpu_adam').reason}"


def test_best_isa_on_this_cpu():
    flags = open("/proc/cpuinfo").read()
    expected = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags and " f16c" in flags else "scalar"
    assert adam.selected_isa() == expected


@pytest.fixture(params=_isas() + ["fallback"])
def impl(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(adam, "_native", lambda: None)
    else:
        monkeypatch.setenv("DSRUN_CPU_ISA", request.param)
        assert adam.selected_isa() == request.param
    return request.param


def _reference(p0, grads, scale, adamw, wd, lr=1e-2):
    ref = p0.clone().requires_grad_()
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd, foreach=False)
    for g in grads:
        ref.grad = g.float() * scale
        opt.step()
    return ref.detach(), opt.state[ref]["exp_avg"], opt.state[ref]["exp_avg_sq"]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype,copy_dtype", DTYPES)
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_step_matches_torch(impl, n, grad_dtype, copy_dtype, adamw):
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).mul_(4).to(grad_dtype) for _ in range(STEPS)]
    scale, wd = 0.25, 0.1
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    copy = torch.full((n,), 7.0, dtype=copy_dtype) if copy_dtype else None
    for step, g in enumerate(grads, start=1):
        adam.adam_step(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=wd,
                       adamw_mode=adamw, grad_scale=scale, param_copy=copy)
    ref_p, ref_m, ref_v = _reference(p0, grads, scale, adamw, wd)
    torch.testing.assert_close(m, ref_m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, ref_v, rtol=1e-5, atol=1e-7)
    # Where g + wd*p nearly cancels (Adam's L2 form), m/sqrt(v) amplifies the
    # one-ulp difference of a fused multiply-add: allow 0.3% of lr.
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=3e-5)
    if copy is not None:  # the copy is the updated parameter rounded to nearest even, exactly
        assert torch.equal(copy, p.to(copy_dtype))


def test_without_bias_correction(impl):
    # DeepSpeed's bias_correction=False: step_size = lr and no sqrt(1 - beta2^t).
    n = 1003
    p, m, v = torch.linspace(-1, 1, n), torch.zeros(n), torch.zeros(n)
    g = torch.cos(torch.arange(n, dtype=torch.float32))
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    for step in (1, 2):
        adam.adam_step(p, g, m, v, step=step, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1,
                       bias_correction=False)
        rp.mul_(1 - 0.01 * 0.1)
        rm.mul_(0.9).add_(g, alpha=0.1)
        rv.mul_(0.99).addcmul_(g, g, value=0.01)
        rp.addcdiv_(rm, rv.sqrt().add_(1e-6), value=-0.01)
    torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-6)


def test_copy_rounding_of_special_values(impl):
    # Values at rounding ties, nan, inf, overflow to fp16 inf, subnormals: with
    # lr=0 the parameter is unchanged, so the copy must equal torch's cast.
    specials = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), math.nan, math.inf, -math.inf,
                             70000.0, 1e-40, 3e-8, 0.0, -0.0, 65520.0, 2.0**-24 * 1.5] * 3)
    n = specials.numel()
    for dtype in (torch.bfloat16, torch.float16):
        p = specials.clone()
        copy = torch.empty(n, dtype=dtype)
        adam.adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, param_copy=copy)
        torch.testing.assert_close(copy, specials.to(dtype), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_grad_sq_norm(impl, dtype, n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = g.double().square().sum().item()
    assert adam.grad_sq_norm(g) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    if n:
        for bad in (math.inf, -math.inf, math.nan):
            h = g.clone()
            h[n // 2] = bad
            assert not math.isfinite(adam.grad_sq_norm(h))


def test_unscale_and_clip_matches_torch_clip():
    g = torch.randn(1000) * 1024.0  # carries a loss scale of 1024
    scale, norm, found_inf = adam.unscale_and_clip_coefficient(adam.grad_sq_norm(g), loss_scale=1024.0, max_norm=1.0)
    t = torch.nn.Parameter(torch.zeros(1000))
    t.grad = g / 1024.0
    ref_norm = torch.nn.utils.clip_grad_norm_([t], 1.0)
    assert not found_inf and norm == pytest.approx(ref_norm.item(), rel=1e-6)
    torch.testing.assert_close(g * scale, t.grad, rtol=1e-6, atol=1e-7)
    assert adam.unscale_and_clip_coefficient(math.inf, 1024.0, 1.0)[2]
    assert adam.unscale_and_clip_coefficient(math.nan)[2]
    assert adam.unscale_and_clip_coefficient(4.0, 1.0, 0.0) == (1.0, 2.0, False)


def test_cpu_adam_optimizer_matches_torch_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 3))
    ref_model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 3))
    ref_model.load_state_dict(model.state_dict())
    opt = adam.CPUAdam(model.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.01, fused=True)
    x, y = torch.randn(64, 13), torch.randn(64, 3)
    for _ in range(5):
        for mdl, o in ((model, opt), (ref_model, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(mdl(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert int(opt.state[next(model.parameters())]["step"]) == 5


def test_bad_inputs_raise_clear_errors():
    p = torch.zeros(10)
    with pytest.raises(ValueError, match="grad: expected a contiguous CPU tensor of 10 elements"):
        adam.adam_step(p, torch.zeros(9), torch.zeros(10), torch.zeros(10), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="not contiguous"):
        adam.adam_step(p, torch.zeros(20)[::2], torch.zeros(10), torch.zeros(10), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="param_copy"):
        adam.adam_step(p, torch.zeros(10), torch.zeros(10), torch.zeros(10), step=1, lr=1e-3,
                       param_copy=torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="step must be >= 1"):
        adam.adam_step(p, torch.zeros(10), torch.zeros(10), torch.zeros(10), step=0, lr=1e-3)
    with pytest.raises(ValueError, match="fp32 CPU parameters"):
        adam.CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])


def test_isa_override_validation(monkeypatch):
    monkeypatch.setenv("DSRUN_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="expected one of"):
        adam.selected_isa()

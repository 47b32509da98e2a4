"""DeepSpeed's optimizer names (dsrun.ops.adam / lion / adagrad) against torch references, on CPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import dsrun
from dsrun.ops import adam
from dsrun.ops.adagrad import DeepSpeedCPUAdagrad
from dsrun.ops.adam import CPUAdam, DeepSpeedCPUAdam, FusedAdam
from dsrun.ops.lion import DeepSpeedCPULion, FusedLion, Lion

STEPS = 4
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.99), 1e-8, 0.1


def _shapes() -> list[torch.Tensor]:
    # A matrix, a vector, a scalar and a non-contiguous (transposed) matrix.
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(7, 5, generator=gen), torch.randn(33, generator=gen), torch.randn((), generator=gen),
            torch.randn(6, 4, generator=gen).t()]


def _grads(shapes: list[torch.Tensor], steps: int = STEPS) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(s.shape, generator=gen) for s in shapes] for _ in range(steps)]


def _run(opt_factory, params: list[torch.nn.Parameter], grads, dtype=None) -> torch.optim.Optimizer:
    opt = opt_factory(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype or p.dtype)
        opt.step()
    return opt


def _params(dtype=torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(t.to(dtype)) for t in _shapes()]


@pytest.fixture(params=["native", "fallback"])
def impl(request, monkeypatch):
    """Run a test with the C++ kernel (when built) and with the PyTorch fallback."""
    if request.param == "fallback":
        monkeypatch.setattr(adam, "_native", lambda: None)
    elif not adam.native_available():
        pytest.skip("the cpu_adam kernel did not build here")
    return request.param


def _torch_adam(adamw: bool):
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    return lambda ps: cls(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)


def _adam_without_bias_correction(params, grads, adamw: bool) -> list[torch.Tensor]:
    """Adam written out with bias_correction off: p -= lr * m / (sqrt(v) + eps)."""
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for step_grads in grads:
        for p, m, v, g in zip(ps, ms, vs, step_grads):
            g = g if adamw else g + WD * p
            if adamw:
                p.mul_(1 - LR * WD)
            m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
            v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            p.sub_(LR * m / (v.sqrt() + EPS))
    return ps


def _assert_params_close(got, want, **tol) -> None:
    for a, b in zip(got, want):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), **(tol or dict(rtol=1e-5, atol=1e-6)))


# ---- DeepSpeedCPUAdam --------------------------------------------------------------

@pytest.mark.parametrize("adamw", [True, False])
def test_cpu_adam_equals_torch(impl, adamw):
    grads = _grads(_shapes())
    ref = _run(_torch_adam(adamw), _params(), grads)
    params = _params()
    got = _run(lambda ps: DeepSpeedCPUAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=adamw),
               params, grads)
    _assert_params_close(params, ref.param_groups[0]["params"])
    assert not params[3].is_contiguous()  # stepped through a contiguous copy and written back
    first = got.state[params[0]]
    assert int(first["step"]) == STEPS and first["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_adam_16bit_params_keep_an_fp32_copy(impl, dtype):
    """The fp32 copy follows torch's fp32 AdamW exactly; the 16-bit parameter is that copy rounded."""
    grads = [[g.to(dtype).float() for g in gs] for gs in _grads(_shapes())]  # values a 16-bit grad can hold
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]
    ref_params = [torch.nn.Parameter(p.detach().float()) for p in params]  # the same (rounded) start
    ref = _run(_torch_adam(True), ref_params, grads)
    opt = _run(lambda ps: DeepSpeedCPUAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), params, grads, dtype)
    for p, r in zip(params, ref.param_groups[0]["params"]):
        master = opt.state[p]["master_param"]
        assert p.dtype == dtype and master.dtype == torch.float32
        torch.testing.assert_close(master, r.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.detach(), r.detach().to(dtype))


def test_cpu_adam_bias_correction_off(impl):
    grads = _grads(_shapes())
    for adamw in (True, False):
        params = _params()
        _run(lambda ps: DeepSpeedCPUAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=adamw,
                                         bias_correction=False), params, grads)
        _assert_params_close(params, _adam_without_bias_correction(_params(), grads, adamw))


def test_cpu_adam_state_dict_round_trip():
    """Stop after 2 steps, load the state into a fresh optimizer, go on: same as 4 steps straight."""
    grads = _grads(_shapes())
    straight = _params()
    _run(lambda ps: DeepSpeedCPUAdam(ps, lr=LR, weight_decay=WD), straight, grads)
    params = _params()
    first = _run(lambda ps: DeepSpeedCPUAdam(ps, lr=LR, weight_decay=WD), params, grads[:2])
    second = _run(lambda ps: DeepSpeedCPUAdam(ps, lr=LR, weight_decay=WD), params, [])
    second.load_state_dict(first.state_dict())
    for step_grads in grads[2:]:
        for p, g in zip(params, step_grads):
            p.grad = g
        second.step()
    _assert_params_close(params, straight, rtol=0, atol=0)


def test_cpu_adam_bad_arguments():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        DeepSpeedCPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="fp32_optimizer_states=False.*fp32 only"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], fp32_optimizer_states=False)
    with pytest.raises(ValueError, match="CPU parameters in fp32, bf16 or fp16, got torch.float64"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    opt = DeepSpeedCPUAdam([p])
    with pytest.raises(ValueError, match="got torch.float64"):  # later groups are checked too
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]})
    with pytest.raises(ValueError, match="invalid hyperparameters"):
        DeepSpeedCPUAdam([p], betas=(0.9, 1.0))
    DeepSpeedCPUAdam([p], fp32_optimizer_states=False)  # fp32 parameters: the same thing


# ---- FusedAdam ---------------------------------------------------------------------

@pytest.fixture(params=["cpu_kernel", "multi_tensor"])
def fused_path(request, monkeypatch):
    """FusedAdam on CPU tensors, through adam_step, or forced through multi_tensor_adam's PyTorch fallback."""
    if request.param == "multi_tensor":
        monkeypatch.setattr(FusedAdam, "_on_cpu", staticmethod(lambda p: False))
    return request.param


@pytest.mark.parametrize("adamw", [True, False])
def test_fused_adam_equals_torch(fused_path, adamw):
    grads = _grads(_shapes())
    ref = _run(_torch_adam(adamw), _params(), grads)
    params = _params()
    opt = _run(lambda ps: FusedAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=adamw),
               params, grads)
    _assert_params_close(params, ref.param_groups[0]["params"])
    assert opt.adam_w_mode == adamw and int(opt.state[params[1]]["step"]) == STEPS


def test_fused_adam_bias_correction_off(fused_path):
    grads = _grads(_shapes())
    for adamw in (True, False):
        params = _params()
        _run(lambda ps: FusedAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=adamw,
                                  bias_correction=False), params, grads)
        _assert_params_close(params, _adam_without_bias_correction(_params(), grads, adamw))


def test_fused_adam_bf16_params_round_every_step(fused_path):
    """As DeepSpeed's FusedAdam: the bf16 parameter is the master; each step rounds into it."""
    dtype = torch.bfloat16
    grads = [[g.to(dtype).float() for g in gs] for gs in _grads(_shapes())]
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref_opt = _torch_adam(True)(ref)
    opt = FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step_grads in grads:
        for p, r, g in zip(params, ref, step_grads):
            p.grad, r.grad = g.to(dtype), g.clone()
        opt.step()
        ref_opt.step()
        for r in ref:
            r.data.copy_(r.data.to(dtype).float())
    assert all("master_param" not in s for s in opt.state.values())
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r.detach().to(dtype))


def test_fused_adam_zero_grad_and_errors():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    FusedAdam([p]).zero_grad()
    assert p.grad is None
    p.grad = torch.ones(3)
    FusedAdam([p], set_grad_none=False).zero_grad()
    assert torch.equal(p.grad, torch.zeros(3))
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        FusedAdam([p], amsgrad=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("adamw", [True, False])
def test_fused_adam_on_cuda_equals_torch(adamw):
    grads = _grads(_shapes())
    ref = _run(_torch_adam(adamw), _params(), grads)
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    _run(lambda ps: FusedAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=adamw),
         params, [[g.cuda() for g in gs] for gs in grads])
    _assert_params_close([p.cpu() for p in params], ref.param_groups[0]["params"], rtol=1e-5, atol=3e-5)


# ---- native-Adam helpers -------------------------------------------------------------

def test_is_native_adam_and_hyperparams():
    p = torch.nn.Parameter(torch.zeros(3))
    for opt in (CPUAdam([p]), DeepSpeedCPUAdam([p]), FusedAdam([p]), torch.optim.Adam([p]),
                torch.optim.AdamW([p], fused=True)):
        assert adam.is_native_adam(opt), type(opt).__name__
    for opt in (torch.optim.Adam([p], amsgrad=True), torch.optim.AdamW([p], maximize=True),
                torch.optim.SGD([p], lr=0.1), type("MyAdam", (torch.optim.Adam,), {})([p])):
        assert not adam.is_native_adam(opt)

    def hyper(opt):
        return adam.adam_hyperparams(opt.param_groups[0], opt)

    assert hyper(torch.optim.AdamW([p], lr=0.5, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)) == dict(
        lr=0.5, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.2, adamw_mode=True, bias_correction=True)
    assert not hyper(torch.optim.Adam([p]))["adamw_mode"]
    assert hyper(torch.optim.Adam([p], decoupled_weight_decay=True))["adamw_mode"]
    assert not hyper(DeepSpeedCPUAdam([p], adamw_mode=False))["adamw_mode"]
    assert not hyper(FusedAdam([p], adam_w_mode=False, bias_correction=False))["bias_correction"]
    groups = FusedAdam([{"params": [p], "adamw_mode": False}, {"params": [torch.nn.Parameter(torch.zeros(1))]}])
    assert [adam.adamw_mode(g, groups) for g in groups.param_groups] == [False, True]
    with pytest.raises(TypeError, match="SGD is not an Adam"):
        adam.adamw_mode({}, torch.optim.SGD([p], lr=0.1))


def test_native_step_on_flat_partition_equals_optimizer_step():
    """What ZeRO will do: adam_step on a flat view with the optimizer's hyperparameters and state."""
    grads = _grads(_shapes()[:2])
    flat = torch.cat([t.reshape(-1) for t in _shapes()[:2]])
    opt = DeepSpeedCPUAdam([torch.nn.Parameter(flat.clone())], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    p = opt.param_groups[0]["params"][0]
    reference = p.detach().clone()
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    for step, gs in enumerate(grads, start=1):
        p.grad = torch.cat([g.reshape(-1) for g in gs])
        opt.step()
        adam.adam_step(reference, p.grad, m, v, step=step, **adam.adam_hyperparams(opt.param_groups[0], opt))
    torch.testing.assert_close(p.detach(), reference, rtol=0, atol=0)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], v, rtol=0, atol=0)


# ---- Lion ----------------------------------------------------------------------------

def _lion_reference(params, grads, wd: float, betas=(0.9, 0.99), lr=1e-2) -> list[torch.Tensor]:
    """Lion's Algorithm 2 (Chen et al. 2023), written out in fp32."""
    ps = [p.detach().float().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    for step_grads in grads:
        for p, m, g in zip(ps, ms, step_grads):
            c = betas[0] * m + (1 - betas[0]) * g
            p.sub_(lr * (torch.sign(c) + wd * p))
            m.mul_(betas[1]).add_(g, alpha=1 - betas[1])
    return ps


@pytest.mark.parametrize("cls", [DeepSpeedCPULion, FusedLion])
def test_lion_classes_follow_algorithm_2(cls):
    grads = _grads(_shapes())
    params = _params()
    opt = _run(lambda ps: cls(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=WD), params, grads)
    _assert_params_close(params, _lion_reference(_params(), grads, WD))
    assert isinstance(opt, Lion)


def test_cpu_lion_bf16_params_keep_fp32_momentum():
    dtype = torch.bfloat16
    grads = [[g.to(dtype).float() for g in gs] for gs in _grads(_shapes(), steps=1)]
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]
    start = [p.detach().float() for p in params]
    opt = _run(lambda ps: DeepSpeedCPULion(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=WD), params, grads, dtype)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    for p, r in zip(params, _lion_reference(start, grads, WD)):
        torch.testing.assert_close(p.detach(), r.to(dtype))
    fused = _run(lambda ps: FusedLion(ps), [torch.nn.Parameter(torch.zeros(3, dtype=dtype))],
                 [[torch.ones(3)]], dtype)
    assert all(s["exp_avg"].dtype == dtype for s in fused.state.values())  # DeepSpeed's FusedLion: param dtype


def test_lion_zero_grad_and_device_check():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    FusedLion([p]).zero_grad()
    assert p.grad is None
    with pytest.raises(ValueError, match="DeepSpeedCPULion needs CPU parameters, got one on meta"):
        DeepSpeedCPULion([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(ValueError, match="betas"):
        FusedLion([p], betas=(0.9, 1.5))


# ---- Adagrad -------------------------------------------------------------------------

def test_cpu_adagrad_equals_torch():
    grads = _grads(_shapes())
    ref = _run(lambda ps: torch.optim.Adagrad(ps, lr=LR, eps=1e-10, weight_decay=WD, foreach=False),
               _params(), grads)
    params = _params()
    opt = _run(lambda ps: DeepSpeedCPUAdagrad(ps, lr=LR, weight_decay=WD), params, grads)
    _assert_params_close(params, ref.param_groups[0]["params"])
    assert opt.defaults["lr_decay"] == 0 and opt.defaults["initial_accumulator_value"] == 0
    assert opt.defaults["fused"]  # CPU parameters: torch's fused CPU kernel


def test_cpu_adagrad_errors():
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.zeros(3))], amsgrad=True)
    with pytest.raises(ValueError, match="needs fp32 parameters, got torch.bfloat16"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])


# ---- import paths --------------------------------------------------------------------

def test_deepspeed_attribute_paths():
    """`import dsrun as deepspeed` then DeepSpeed's dotted names."""
    deepspeed = dsrun
    assert deepspeed.ops.adam.DeepSpeedCPUAdam is DeepSpeedCPUAdam
    assert deepspeed.ops.adam.FusedAdam is FusedAdam
    assert deepspeed.ops.lion.DeepSpeedCPULion is DeepSpeedCPULion and deepspeed.ops.lion.FusedLion is FusedLion
    assert deepspeed.ops.adagrad.DeepSpeedCPUAdagrad is DeepSpeedCPUAdagrad
    with pytest.raises(AttributeError):
        deepspeed.ops.no_such_op


def test_adam_works_without_the_native_library():
    """With the kernel disabled, importing and stepping run the PyTorch fallback."""
    code = ("import torch\n"
            "from dsrun.ops.adam import DeepSpeedCPUAdam, FusedAdam, native_available\n"
            "p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
            "for cls in (DeepSpeedCPUAdam, FusedAdam):\n"
            "    cls([p], lr=0.1).step()\n"
            "print(native_available(), round(float(p[0]), 4))\n")
    env = {**os.environ, "DSRUN_OPS_DISABLE": "cpu_adam"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "0.8"]

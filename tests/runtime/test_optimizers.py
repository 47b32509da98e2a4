"""Optimizers built from ds_config have DeepSpeed's semantics; Lion follows the paper."""
from __future__ import annotations

import pytest
import torch

from dsrun.ops import lion
from dsrun.ops.adam import DeepSpeedCPUAdam, FusedAdam, is_native_adam
from dsrun.runtime.config import ConfigError
from dsrun.runtime.optim.optimizers import Lion, build_optimizer


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))


def test_adam_defaults_to_native_decoupled_weight_decay() -> None:
    """DeepSpeed's Adam is AdamW unless adam_w_mode is false; weight_decay defaults to 0.

    Without torch_adam it is dsrun's native Adam (DeepSpeedCPUAdam for CPU
    parameters); with torch_adam: true it is torch's fused Adam/AdamW.
    """
    opt = build_optimizer("Adam", {}, [_param()])
    assert type(opt) is DeepSpeedCPUAdam and opt.adam_w_mode and opt.defaults["weight_decay"] == 0.0
    assert not build_optimizer("adam", {"adam_w_mode": False}, [_param()]).adam_w_mode
    assert build_optimizer("AdamW", {"adam_w_mode": False}, [_param()]).adam_w_mode  # AdamW: always decoupled
    assert type(build_optimizer("Adam", {"torch_adam": True}, [_param()])) is torch.optim.AdamW
    torch_adam = build_optimizer("Adam", {"adam_w_mode": False, "torch_adam": True}, [_param()])
    assert type(torch_adam) is torch.optim.Adam and torch_adam.defaults["fused"]
    assert type(build_optimizer("AdamW", {"adam_w_mode": False, "torch_adam": True},
                                [_param()])) is torch.optim.AdamW
    assert all(is_native_adam(build_optimizer("Adam", {"torch_adam": t}, [_param()])) for t in (False, True))


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_config_adam_equals_torch(adam_w_mode: bool) -> None:
    """The native default and torch_adam: true take the same steps (fp32 rounding)."""
    options = {"lr": 0.05, "betas": [0.8, 0.95], "weight_decay": 0.1, "adam_w_mode": adam_w_mode}
    native, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref.load_state_dict(native.state_dict())
    opts = [build_optimizer("Adam", options, native.parameters()),
            build_optimizer("Adam", {**options, "torch_adam": True}, ref.parameters())]
    x = torch.randn(8, 4)
    for _ in range(4):
        for model, opt in zip((native, ref), opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(native.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_config_bias_correction_false() -> None:
    """bias_correction: false drops 1/(1 - beta^t): the first step moves by lr * g / (|g| * sqrt(1 - b2))."""
    p = _param()
    opt = build_optimizer("Adam", {"lr": 0.1, "betas": [0.9, 0.99], "eps": 0.0, "bias_correction": False},
                          [p])
    assert not opt.defaults["bias_correction"]
    p.grad = torch.tensor([1.0, -1.0, 2.0])
    opt.step()
    step = 0.1 * (1 - 0.9) / (1 - 0.99) ** 0.5
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 - step, -2.0 + step, 3.0 - step]))
    with pytest.raises(ConfigError, match="bias_correction: false needs dsrun's Adam"):
        build_optimizer("Adam", {"bias_correction": False, "torch_adam": True}, [_param()])


def test_config_amsgrad_needs_torch_adam() -> None:
    with pytest.raises(ConfigError, match=r"amsgrad.*no AMSGrad.*torch_adam"):
        build_optimizer("Adam", {"amsgrad": True}, [_param()])
    opt = build_optimizer("AdamW", {"amsgrad": True, "torch_adam": True}, [_param()])
    assert type(opt) is torch.optim.AdamW and opt.defaults["amsgrad"]


def test_config_adam_on_cuda_is_fused_adam() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    opt = build_optimizer("Adam", {}, [torch.nn.Parameter(torch.zeros(3, device="cuda"))])
    assert type(opt) is FusedAdam


def test_torch_optimizers_by_name_and_json_lists() -> None:
    sgd = build_optimizer("sgd", {"lr": 0.1, "momentum": 0.9}, [_param()])
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    ada = build_optimizer("Adagrad", {"lr": 0.1}, [_param()])
    assert type(ada) is torch.optim.Adagrad
    adam = build_optimizer("Adam", {"betas": [0.8, 0.9]}, [_param()])
    assert adam.defaults["betas"] == (0.8, 0.9)


def test_param_groups_are_kept() -> None:
    a, b = _param(), _param()
    opt = build_optimizer("AdamW", {"lr": 0.1}, [{"params": [a]}, {"params": [b], "lr": 0.5}])
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    # A group's parameters may be a generator: the device check must not use them up.
    opt = build_optimizer("Adam", {}, [{"params": (p for p in [a, b]), "weight_decay": 0.1}])
    assert opt.param_groups[0]["params"] == [a, b] and opt.param_groups[0]["weight_decay"] == 0.1


def test_unknown_param_and_type_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.params\.beta1.*accepted: .*betas"):
        build_optimizer("Adam", {"beta1": 0.9}, [_param()])
    with pytest.raises(ConfigError, match=r"optimizer\.params\.nesterov_x.*accepted: .*momentum"):
        build_optimizer("SGD", {"lr": 0.1, "nesterov_x": True}, [_param()])
    with pytest.raises(ConfigError, match="unknown optimizer 'Adamm'"):
        build_optimizer("Adamm", {}, [_param()])


def test_lion_matches_algorithm_2() -> None:
    """Two Lion steps against the update written out from Chen et al. 2023, Alg. 2."""
    lr, b1, b2, wd = 0.1, 0.9, 0.99, 0.5
    p = _param()
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    theta, m = p.detach().clone(), torch.zeros(3)
    for g in (torch.tensor([0.5, -0.1, 0.0]), torch.tensor([-1.0, 0.2, 0.3])):
        p.grad = g.clone()
        opt.step()
        c = b1 * m + (1 - b1) * g
        theta = theta - lr * (torch.sign(c) + wd * theta)
        m = b2 * m + (1 - b2) * g
        torch.testing.assert_close(p.detach(), theta)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m)


def test_lion_from_config() -> None:
    opt = build_optimizer("Lion", {"lr": 1e-4, "betas": [0.95, 0.98]}, [_param()])
    assert isinstance(opt, Lion) and opt.defaults["betas"] == (0.95, 0.98)
    assert Lion is lion.Lion  # one implementation, in dsrun.ops.lion

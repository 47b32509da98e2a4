"""Optimizers built from ds_config have DeepSpeed's semantics; Lion follows the paper."""
from __future__ import annotations

import pytest
import torch

from dsrun.runtime.config import ConfigError
from dsrun.runtime.optimizers import Lion, build_optimizer


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))


def test_adam_defaults_to_decoupled_weight_decay() -> None:
    """DeepSpeed's Adam is AdamW unless adam_w_mode is false; weight_decay defaults to 0."""
    assert type(build_optimizer("Adam", {}, [_param()])) is torch.optim.AdamW
    assert build_optimizer("adam", {}, [_param()]).defaults["weight_decay"] == 0.0
    assert type(build_optimizer("Adam", {"adam_w_mode": False, "torch_adam": True},
                                [_param()])) is torch.optim.Adam
    assert type(build_optimizer("AdamW", {"adam_w_mode": False}, [_param()])) is torch.optim.AdamW


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

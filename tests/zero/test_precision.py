"""Loss scalers and precision policy (DeepSpeed semantics)."""
from types import SimpleNamespace

import pytest
import torch

from dsrun.runtime.optim.precision import (DynamicLossScaler, LossScaler, LossScaleUnderflowError,
                                     PrecisionPolicy, first_nonfinite)


def test_dynamic_scaler_hysteresis_and_growth():
    s = DynamicLossScaler(init_scale=2 ** 4, window=3, hysteresis=2, min_scale=1)
    assert s.update(True) is False and s.scale == 16  # first overflow uses hysteresis
    assert s.update(True) is False and s.scale == 8   # second one halves
    assert s.update(True) is False and s.scale == 4   # budget stays empty until a window passes
    for _ in range(2):
        assert s.update(False) is True and s.scale == 4
    assert s.update(False) is True and s.scale == 8   # 3 clean steps since the overflow
    assert s.hysteresis_left == 2


def test_consecutive_hysteresis_refills_after_each_clean_step():
    s = DynamicLossScaler(init_scale=8, window=100, hysteresis=2, consecutive_hysteresis=True)
    for _ in range(3):
        s.update(True)
        s.update(False)
    assert s.scale == 8  # never two overflows in a row
    s.update(True)
    s.update(True)
    assert s.scale == 4


def test_min_scale_is_an_error_that_says_what_to_try():
    s = DynamicLossScaler(init_scale=2, window=10, hysteresis=1, min_scale=1)
    s.update(True)
    assert s.scale == 1
    with pytest.raises(LossScaleUnderflowError, match="bf16"):
        s.update(True)


def test_state_dict_round_trip_and_static():
    s = DynamicLossScaler(init_scale=32, window=2)
    s.update(True); s.update(False)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    static = LossScaler(128.0)
    assert static.update(True) is False and static.scale == 128.0
    with pytest.raises(ValueError):
        LossScaler(0)


def _cfg(fp16=False, bf16=False, loss_scale=0.0, accum=None):
    fp = SimpleNamespace(enabled=fp16, loss_scale=loss_scale, initial_scale_power=5,
                         loss_scale_window=7, hysteresis=3, consecutive_hysteresis=False,
                         min_loss_scale=0.5)
    return SimpleNamespace(fp16=fp, bf16=SimpleNamespace(enabled=bf16),
                           data_types=SimpleNamespace(grad_accum_dtype=accum))


def test_policy_from_config():
    p = PrecisionPolicy.from_config(_cfg(bf16=True))
    assert (p.compute_dtype, p.master_dtype, p.grad_accum_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert p.mixed and p.scaler.scale == 1.0 and not p.scaler.dynamic
    p = PrecisionPolicy.from_config(_cfg(bf16=True, accum="bf16"))
    assert p.grad_accum_dtype == torch.bfloat16
    p = PrecisionPolicy.from_config(_cfg(fp16=True))
    assert p.compute_dtype == torch.float16 and p.scaler.dynamic and p.scaler.scale == 32
    assert p.scaler.window == 7 and p.scaler.hysteresis == 3 and p.scaler.min_scale == 0.5
    assert PrecisionPolicy.from_config(_cfg(fp16=True, loss_scale=64)).scaler.scale == 64
    assert not PrecisionPolicy.from_config(_cfg()).mixed
    with pytest.raises(ValueError, match="at most one"):
        PrecisionPolicy.from_config(_cfg(fp16=True, bf16=True))


def test_first_nonfinite():
    ts = [("a", torch.ones(2)), ("b", torch.tensor([1.0, float("inf")])), ("c", torch.tensor([float("nan")]))]
    assert first_nonfinite(ts) == "b"
    assert first_nonfinite(ts[:1]) is None

"""Config semantics as DeepSpeed has them: client objects win, Accelerate's and
Hugging Face's injected forms load, unknown keys warn unless they look like
typos, and a config's problems are reported in one round."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

import dsrun as deepspeed
from dsrun.runtime.config import ConfigError, ConfigWarning, load_config

BASE = {"train_batch_size": 2}


def test_client_optimizer_and_scheduler_win_with_a_notice(caplog):
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    deepspeed.utils.logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="dsrun"):
            engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=optimizer,
                                                         lr_scheduler=scheduler, config=config)
    finally:
        deepspeed.utils.logger.propagate = False
    assert opt is optimizer and sched is scheduler and engine.get_lr() == [0.25]
    notices = sorted({r.getMessage() for r in caplog.records if "as DeepSpeed does" in r.getMessage()})
    assert len(notices) == 2  # one line each (distinct: a handler left by another test may repeat them)
    assert "'optimizer' section names AdamW" in notices[1] and "'scheduler' section names WarmupLR" in notices[0]


def test_steps_per_print_inf_means_never():
    assert load_config({**BASE, "steps_per_print": float("inf")}).steps_per_print == 2**63 - 1
    with pytest.raises(ConfigError, match="steps_per_print: expected a positive integer"):
        load_config({**BASE, "steps_per_print": 0})


@pytest.mark.parametrize("section", ["hybrid_engine", "amp", "elasticity", "compression_training",
                                     "curriculum_learning"])
def test_disabled_deepspeed_sections_are_accepted(section):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({**BASE, section: {"enabled": False}})
    with pytest.raises(ConfigError, match=f"{section}: .* is a DeepSpeed feature that dsrun does not implement"):
        load_config({**BASE, section: {"enabled": True}})


def test_legacy_zero_optimization_bool():
    assert load_config({**BASE, "zero_optimization": True}).zero_optimization.stage == 1
    assert load_config({**BASE, "zero_optimization": False}).zero_optimization.stage == 0


def test_unknown_keys_warn_typos_fail_strict_switch(monkeypatch):
    monkeypatch.delenv("DSRUN_STRICT_CONFIG", raising=False)
    with pytest.warns(ConfigWarning, match="unknown keys ignored.*cuda_visible_devices, bf16.note"):
        cfg = load_config({**BASE, "cuda_visible_devices": "0", "bf16": {"enabled": True, "note": "x"}})
    assert cfg.bf16.enabled
    with pytest.raises(ConfigError, match="did you mean 'steps_per_print'"):
        load_config({**BASE, "steps_per_prnt": 5})
    monkeypatch.setenv("DSRUN_STRICT_CONFIG", "1")
    with pytest.raises(ConfigError, match="cuda_visible_devices: unknown key"):
        load_config({**BASE, "cuda_visible_devices": "0"})
    with pytest.raises(ConfigError, match="cuda_visible_devices: unknown key"):
        load_config({**BASE, "cuda_visible_devices": "0"}, strict=True)


def test_all_problems_in_one_round():
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "zero_optimization": {"stage": 9, "reduce_bucket_size": 0},
                     "fp16": {"enabeld": True, "fp16_master_weights_and_grads": True}, "gradient_clipping": "high"})
    text = str(info.value)
    for part in ("zero_optimization.stage: expected an integer 0-3", "zero_optimization.reduce_bucket_size",
                 "fp16.enabeld: unknown key",
                 "fp16.fp16_master_weights_and_grads=true", "gradient_clipping: expected a number"):
        assert part in text
    assert len(info.value.problems) == 5


@pytest.mark.parametrize("stage", [0, 3])
def test_adam_bias_correction_false_takes_effect(stage):
    """DeepSpeed's Adam `bias_correction` (24 of 70 real configs set it): the
    first step is lr * m / sqrt(v); corrected, m/sqrt(v) = g/|g|; uncorrected,
    (1 - beta1) g / (sqrt(1 - beta2) |g|), i.e. 0.1 / sqrt(0.001) = 3.16 times larger."""
    steps = {}
    for correct in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, bias=False)
        before = model.weight.detach().clone()
        engine, *_ = deepspeed.initialize(model=model, config={
            **BASE, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": correct, "eps": 1e-12}}})
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss)
        engine.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            steps[correct] = (engine.module.weight.detach() - before).abs().mean().item()
    assert steps[False] / steps[True] == pytest.approx(0.1 / 0.001 ** 0.5, rel=1e-3)

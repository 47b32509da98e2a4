"""A checkpoint loaded with another gradient_accumulation_steps keeps the accumulation boundary on a
whole window (load._realign_micro_steps): a restart on fewer ranks with train_batch_size fixed."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from dsrun.runtime.checkpoint.load import _realign_micro_steps
from dsrun.runtime.engine.train_state import TrainState


def realign(saved_gas: int, gas: int, micro_steps: int) -> int:
    parts = SimpleNamespace(config=SimpleNamespace(gradient_accumulation_steps=gas),
                            state=TrainState(micro_steps=micro_steps), topology=SimpleNamespace(rank=0))
    _realign_micro_steps(parts, SimpleNamespace(config={"gradient_accumulation_steps": saved_gas}))
    return parts.state.micro_steps


@pytest.mark.parametrize("saved_gas,gas,micro_steps,expected", [
    (2, 4, 6, 12),   # 3 windows of 2 -> 3 windows of 4: the next micro-step starts window 4
    (4, 2, 12, 6),
    (2, 2, 7, 7),    # same window length: untouched, even mid-window
    (1, 3, 5, 15),
])
def test_whole_windows_are_kept(saved_gas, gas, micro_steps, expected):
    assert realign(saved_gas, gas, micro_steps) == expected
    assert realign(saved_gas, gas, micro_steps) % gas == 0 or saved_gas == gas


def test_a_partial_window_is_dropped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="dsrun.checkpoint"):
        assert realign(4, 2, 9) == 4  # 2 whole windows of 4 done, 1 micro-step into the third
    assert "after micro-step 1 of a 4-step accumulation window" in caplog.text

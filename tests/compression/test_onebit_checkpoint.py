"""Checkpoints of the 1-bit optimizers keep their error-feedback buffers."""
from __future__ import annotations

import pytest
import torch

from tests.compression.test_onebit import OPTIMIZERS, _config, _model, _train
from tests.dist_helpers import run_ranks


def _rank_resume(tmp: str, name: str, precision: str):
    import dsrun
    engine, *_ = dsrun.initialize(model=_model(), config=_config(OPTIMIZERS[name], precision))
    _train(engine, 12)  # freeze_step 10: two compressed steps
    engine.save_checkpoint(tmp, tag="t")
    straight = _train(engine, 4, start=12)
    resumed_engine, *_ = dsrun.initialize(model=_model(seed=9), config=_config(OPTIMIZERS[name], precision))
    resumed_engine.load_checkpoint(tmp, tag="t")
    kept = bool(resumed_engine.optimizer._errors)
    return straight, _train(resumed_engine, 4, start=12), kept


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of OneBitAdam (fp32) and OneBitLamb (bf16) after 12 steps, and each run's results."""
    root = tmp_path_factory.mktemp("onebit")
    runs = {}
    for name, precision in (("OneBitAdam", "fp32"), ("OneBitLamb", "bf16")):
        runs[name] = run_ranks(_rank_resume, 2, str(root / name), name, precision, timeout=180)
    return root, runs


@pytest.mark.slow
def test_resume_continues_bit_for_bit_with_the_saved_errors(saved):
    for name, results in saved[1].items():
        for straight, resumed, kept in results:
            assert kept
            assert straight == resumed, (name, straight, resumed)


def _rank_load_alone(tmp: str):
    import dsrun
    engine, *_ = dsrun.initialize(model=_model(seed=9), config=_config(OPTIMIZERS["OneBitAdam"]))
    engine.load_checkpoint(tmp, tag="t")
    losses = _train(engine, 2, start=12)  # one rank: 2 micro-batches per step, so one step
    return bool(engine.optimizer._errors), engine.optimizer.steps_done(), losses


@pytest.mark.slow
def test_another_world_size_restarts_the_errors_from_zero(saved):
    kept, steps, losses = run_ranks(_rank_load_alone, 1, str(saved[0] / "OneBitAdam"), timeout=120)[0]
    assert not kept and steps == 13  # the step counter came back (12), the errors did not
    assert all(torch.isfinite(torch.tensor(losses)))

"""CurriculumScheduler against DeepSpeed's formula at every step, the custom
and discrete schedules, its state, and the config's errors."""
from __future__ import annotations

import math

import pytest

from dsrun.runtime.config import ConfigError, load_config
from dsrun.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

BASE = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}


def _deepspeed_difficulty(step, lo, hi, total, dstep, degree):
    """DeepSpeed 0.19.8's __fixed_root_get_difficulty, re-derived by hand: the
    fraction of the curriculum done, raised to 1/degree, scaled into [lo, hi],
    floored, rounded down to a multiple of dstep, raised to the first multiple
    of dstep not below lo, capped at hi."""
    x = math.floor((step / total) ** (1 / degree) * (hi - lo) + lo)
    x = (x // dstep) * dstep
    first = ((lo + dstep - 1) // dstep) * dstep
    return min(max(x, first), hi)


@pytest.mark.parametrize("lo,hi,total,dstep,degree", [
    (8, 1024, 100, 8, 1), (64, 512, 37, 8, 1), (8, 128, 50, 16, 1),  # min not a multiple of the step
    (8, 1024, 100, 8, 2), (80, 2048, 250, 8, 3), (1, 100, 60, 7, 1.5), (5, 5, 10, 1, 1)])
def test_fixed_schedules_equal_deepspeeds_formula_at_every_step(lo, hi, total, dstep, degree):
    kind = "fixed_linear" if degree == 1 else "fixed_root"
    schedule = {"total_curriculum_step": total, "difficulty_step": dstep}
    if kind == "fixed_root":
        schedule["root_degree"] = degree
    scheduler = CurriculumScheduler({"min_difficulty": lo, "max_difficulty": hi, "schedule_type": kind,
                                     "schedule_config": schedule})
    assert scheduler.get_current_difficulty() == lo
    for step in range(0, total + 20):
        want = _deepspeed_difficulty(step, lo, hi, total, dstep, degree)
        assert scheduler.get_difficulty(step) == want, step
        assert scheduler.update_difficulty(step) == want, step
        assert want % dstep == 0 or want == hi
    assert scheduler.get_current_difficulty() == hi


def test_fixed_discrete_and_custom():
    discrete = CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
                                    "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}})
    assert [discrete.update_difficulty(s) for s in range(1, 14)] == [1] * 5 + [2] * 5 + [3] * 3
    custom = CurriculumScheduler({"min_difficulty": 4, "max_difficulty": 40, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        custom.update_difficulty(1)
    custom.set_custom_get_difficulty(lambda step: min(4 * step, 50))
    got = [custom.update_difficulty(s) for s in range(1, 15)]
    # DeepSpeed's update moves only while below max_difficulty: a schedule past it stays where it got to
    assert got == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40] + [40] * 4


def test_state_dict_continues_the_schedule_and_keeps_the_custom_function():
    config = {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "custom"}
    a = CurriculumScheduler(config)
    a.set_custom_get_difficulty(lambda s: 8 * s)
    for step in range(1, 4):
        a.update_difficulty(step)
    b = CurriculumScheduler(config)
    b.set_custom_get_difficulty(lambda s: 8 * s)
    b.load_state_dict(a.state_dict())
    assert b.get_current_difficulty() == 24
    assert [b.update_difficulty(s) for s in range(4, 10)] == [a.update_difficulty(s) for s in range(4, 10)]
    b.set_current_difficulty(64)
    assert b.update_difficulty(20) == 64 and b.get_state()["current_difficulty"] == 64
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"current_difficulty": 3})


@pytest.mark.parametrize("section,match", [
    ({"enabled": True, "max_difficulty": 64, "schedule_type": "fixed_linear",
      "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}},
     r"curriculum_learning.min_difficulty: required"),
    ({"enabled": True, "min_difficulty": 128, "max_difficulty": 64, "schedule_type": "fixed_linear",
      "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}, "is above max_difficulty"),
    ({"enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_root",
      "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}, "needs schedule_config.root_degree"),
    ({"enabled": True, "min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
      "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5]}}, "one more difficulty than max_step"),
    ({"enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_cubic"},
     "schedule_type"),
    ({"enabled": True, "curriculum_type": "vocab", "min_difficulty": 8, "max_difficulty": 64,
      "schedule_type": "custom"}, "curriculum_type"),
])
def test_legacy_config_errors(section, match):
    with pytest.raises(ConfigError, match=match):
        load_config({**BASE, "curriculum_learning": section})


def test_data_efficiency_config_errors_and_a_disabled_section_passes():
    metric = {"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "custom"}

    def sampling(metrics, enabled=True):
        return {**BASE, "data_efficiency": {"enabled": True, "data_sampling": {"enabled": True, "curriculum_learning": {
            "enabled": enabled, "curriculum_metrics": metrics}}}}
    with pytest.raises(ConfigError, match="curriculum_metrics.m.index_to_sample_path: dsrun computes"):
        load_config(sampling({"m": {**metric, "index_to_sample_path": "/data/index"}}))
    with pytest.raises(ConfigError, match="percentile difficulties lie in"):
        load_config(sampling({"m": {**metric, "difficulty_type": "percentile", "max_difficulty": 200}}))
    with pytest.raises(ConfigError, match="curriculum_metrics: give at least one metric"):
        load_config(sampling({}))
    half = sampling({"m": metric})
    half["data_efficiency"]["enabled"] = False
    with pytest.raises(ConfigError, match="data_efficiency.data_sampling: .* but enabled false; set all three"):
        load_config(half)
    # DeepSpeed's offline paths in a section that is off are left alone; data_routing is read beside it
    off = sampling({"m": {**metric, "index_to_sample_path": "/x"}}, enabled=False)
    off["data_efficiency"]["data_routing"] = {"random_ltd": {"enabled": False}}
    cfg = load_config(off)
    assert not cfg.data_efficiency.data_routing.random_ltd.enabled
    assert not load_config(sampling({"m": metric}, enabled=False)).data_efficiency.curriculum_sampling
    assert load_config(sampling({"m": metric})).data_efficiency.curriculum_sampling

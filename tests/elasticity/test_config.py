"""The `elasticity` section of a ds_config: validation, and the batch triple load_config takes from it."""
from __future__ import annotations

import warnings

import pytest

from dsrun.runtime.config import ConfigError, ConfigWarning, load_config

# max 20, micro [1, 3]: batch 18 on world sizes 1 2 3 6 9 18 (tests/elasticity/test_compute.py, TIE);
# with prefer_larger_batch false, 12 on 1 2 3 4 6 12.
ELASTIC = {"enabled": True, "max_train_batch_size": 20, "micro_batch_sizes": [1, 3], "version": 0.1}


def _load(world_size: int, **section) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config({"elasticity": {**ELASTIC, **section}}, world_size=world_size)


@pytest.mark.parametrize("world_size, micro, accumulation", [(1, 3, 6), (2, 3, 3), (6, 3, 1), (9, 1, 2)])
def test_batch_triple_comes_from_the_search(world_size, micro, accumulation):
    cfg = _load(world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
        (18, micro, accumulation)
    assert "18 = " in cfg.summary()


def test_reloading_at_another_world_size_searches_again():
    cfg = _load(2)
    again = load_config(cfg, world_size=6)
    assert (again.train_batch_size, again.gradient_accumulation_steps) == (18, 1)


def test_world_size_the_config_does_not_allow_names_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"world size 4 is not one the elastic config allows .*"
                                          r"run on one of \[1, 2, 3, 6, 9, 18\]"):
        _load(4)


def test_batch_keys_beside_elasticity_are_an_error_unless_ignored():
    config = {"train_batch_size": 32, "gradient_accumulation_steps": 4, "elasticity": ELASTIC}
    with pytest.raises(ConfigError, match="train_batch_size, gradient_accumulation_steps: set while elasticity "
                                          "is enabled.*ignore_non_elastic_batch_info"):
        load_config(config, world_size=2)
    config["elasticity"] = {**ELASTIC, "ignore_non_elastic_batch_info": True}
    with pytest.warns(ConfigWarning, match="train_batch_size=32, gradient_accumulation_steps=4 overridden by "
                                           "elasticity: train_batch_size=18, train_micro_batch_size_per_gpu=3, "
                                           "gradient_accumulation_steps=3 for world size 2"):
        cfg = load_config(config, world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (18, 3)


def test_docs_spelling_prefer_large_batch_warns_and_takes_effect():
    with pytest.warns(ConfigWarning, match="elasticity.prefer_large_batch .* is read as "
                                           "elasticity.prefer_larger_batch"):
        cfg = load_config({"elasticity": {**ELASTIC, "prefer_large_batch": False}}, world_size=4)
    assert not cfg.elasticity.prefer_larger_batch
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (12, 3, 1)
    with pytest.raises(ConfigError, match="both 'prefer_large_batch' and 'prefer_larger_batch' are given"):
        load_config({"elasticity": {**ELASTIC, "prefer_large_batch": False, "prefer_larger_batch": True}})


def test_disabled_section_is_validated_but_leaves_the_batch_alone():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "elasticity": {**ELASTIC, "enabled": False}},
                      world_size=4)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)
    with pytest.raises(ConfigError, match="elasticity.max_gpus: max_gpus \\(1\\) is below min_gpus \\(2\\)"):
        load_config({"train_micro_batch_size_per_gpu": 2,
                     "elasticity": {"enabled": False, "min_gpus": 2, "max_gpus": 1}})


@pytest.mark.parametrize("section, message", [
    ({"micro_batch_sizes": []}, "elasticity.micro_batch_sizes: expected a non-empty list of positive integers"),
    ({"micro_batch_sizes": [True]}, "elasticity.micro_batch_sizes: expected a non-empty list"),
    ({"min_gpus": 8, "max_gpus": 2}, r"elasticity.max_gpus: max_gpus \(2\) is below min_gpus \(8\)"),
    ({"max_train_batch_size": 0}, "elasticity.max_train_batch_size: expected a positive integer, got 0"),
    ({"version": 0.5}, "elasticity.version: unknown version 0.5"),
    ({"min_time": -1}, "elasticity.min_time: expected an integer >= 0"),
    ({"prefer_larger_batch": "yes"}, "elasticity.prefer_larger_batch: expected true or false"),
    ({"max_train_batch_size": None}, "elasticity.max_train_batch_size: expected a positive integer"),
])
def test_bad_values_are_config_errors(section, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"elasticity": {**ELASTIC, **section}}, world_size=1)


def test_min_time_is_a_scheduler_hint_without_effect():
    with pytest.warns(ConfigWarning, match="does not act on elasticity.min_time=20"):
        load_config({"elasticity": {**ELASTIC, "min_time": 20}}, world_size=2)


def test_elastic_search_waits_for_a_valid_config():
    """See [Note: order of the checks]: world size 4 is not allowed either, but the
    search runs only on a config whose sections are valid."""
    with pytest.raises(ConfigError) as info:
        load_config({"elasticity": ELASTIC, "fp16": {"enabled": "maybe"}}, world_size=4)
    assert info.value.problems == ["fp16.enabled: expected true or false, got 'maybe'"]

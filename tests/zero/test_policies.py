"""Stage 3's settings as frozen policies, built from the config (dsrun/runtime/zero/policies.py)."""
from __future__ import annotations

import dataclasses

import pytest

from dsrun.runtime.config import load_config
from dsrun.runtime.zero.policies import QWZ_BLOCK, GatherPolicy, ZeroPPPolicy


def _config(**keys):
    return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **keys}},
                       world_size=1)


def test_defaults_are_deepspeeds():
    assert GatherPolicy.from_config(_config()) == GatherPolicy()
    assert GatherPolicy() == GatherPolicy(50_000_000, 1_000_000_000, 1_000_000_000, 100_000, 2**63 - 1, None)
    assert ZeroPPPolicy.from_config(_config()) == ZeroPPPolicy()


def test_from_config_reads_every_key_and_its_aliases():
    cfg = _config(prefetch_bucket_size=11, stage3_max_live_parameters=22, max_reuse_distance=33,
                 stage3_param_persistence_threshold=44, model_persistence_threshold=55,
                 stage3_unit_modules=["h.*", "Block"])
    assert GatherPolicy.from_config(cfg) == GatherPolicy(11, 22, 33, 44, 55, ("h.*", "Block"))
    cfg = _config(zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=1,
                 zero_quantized_nontrainable_weights=True)
    assert ZeroPPPolicy.from_config(cfg) == ZeroPPPolicy(True, True, 1, True)


def test_policies_are_frozen_and_hold_patterns_immutably():
    patterns = ["h.*"]
    policy = GatherPolicy(unit_patterns=patterns)
    patterns.append("x")
    assert policy.unit_patterns == ("h.*",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.prefetch_numel = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZeroPPPolicy().hpz_partition_size = 2


def test_block_sizes_follow_the_flags():
    assert (ZeroPPPolicy().weight_block, ZeroPPPolicy().frozen_block) == (0, 0)
    assert ZeroPPPolicy(quantized_weights=True).weight_block == QWZ_BLOCK
    assert ZeroPPPolicy(quantized_nontrainable_weights=True).frozen_block == QWZ_BLOCK


@pytest.mark.parametrize("kwargs, match", [
    ({"prefetch_numel": -1}, "GatherPolicy.prefetch_numel must be an integer >= 0, got -1"),
    ({"max_live_numel": 1.5}, "max_live_numel must be an integer >= 0, got 1.5"),
    ({"persistence_threshold": True}, "persistence_threshold must be an integer >= 0, got True"),
    ({"unit_patterns": ["h.*", 3]}, "unit_patterns must be strings"),
])
def test_gather_policy_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GatherPolicy(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"hpz_partition_size": 0}, "hpz_partition_size must be an integer >= 1, got 0"),
    ({"quantized_weights": 1}, "ZeroPPPolicy.quantized_weights must be true or false, got 1"),
])
def test_zeropp_policy_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroPPPolicy(**kwargs)

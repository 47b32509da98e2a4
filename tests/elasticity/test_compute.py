"""compute_elastic_config against DeepSpeed's algorithm, with values derived by hand.

Each expected row is worked out from DeepSpeed's search (deepspeed/elasticity/
elasticity.py); the derivations are in the comments so a wrong row can be
checked with pencil and paper.
"""
from __future__ import annotations

import pickle

import pytest

import dsrun
from dsrun.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    elasticity_enabled,
)
from dsrun.elasticity.algorithm import candidate_batch_sizes, valid_world_sizes
from dsrun.runtime.config import ConfigWarning, load_config

DS = "0.16.0"  # a DeepSpeed version with elasticity

# max 2000, micro [2, 4, 6] (DeepSpeed's documented example): bases 2, 4, 6 and lcm 12 scale to
# 2 x 840 = 1680 (840 = largest HCN <= 1000), 4 x 360, 6 x 240, 12 x 120 = 1440. 1680 / m for
# m = 2, 4, 6 is 840, 420, 280, all dividing 840: 32 world sizes (the divisors of 840);
# 1440 gives the 30 divisors of 720. 1680 wins.
DIVISORS_840 = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84, 105,
                120, 140, 168, 210, 280, 420, 840]
DOCS = {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}
# max 20, micro [1, 3]: bases 1 -> 12 (HCN <= 20), 3 and lcm 3 -> 3 x 6 = 18. 12 runs on the
# divisors of 12 (micro 1) plus those of 4 (micro 3): 1 2 3 4 6 12; 18 on those of 18 and of 6:
# 1 2 3 6 9 18. A tie at 6 sizes: prefer_larger_batch decides.
TIE = {"max_train_batch_size": 20, "micro_batch_sizes": [1, 3], "version": 0.1}
# DeepSpeed's unit test: 9792 with 23 world sizes in [32, 1500]; 64 ranks run micro-batch 17.
DS_TEST = {"max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
           "max_gpus": 1500, "min_time": 20, "version": 0.1}
# Version 0.2 per node of 2 GPUs (d = 2 data-parallel ranks per node): the search runs with
# max 64 / 2 = 32 and nodes 1..8: 2 x 12 = 24 and 4 x 6 = 24; 24 / 2 = 12 has divisors <= 8
# 1 2 3 4 6; times d: batch 48, sizes 2 4 6 8 12. A job of 10 or 3 GPUs is not among them: the
# batch becomes the largest multiple of m x 10 (m x 3) within 64 over m: 3 x 20 = 60 (10 x 6 = 60).
NODES = {"max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "min_gpus": 2, "max_gpus": 16,
         "num_gpus_per_node": 2, "version": 0.2}
# Version 0.2 with model parallelism 2 on nodes of 4 (d = 2): max 32 / 2 = 16, nodes 1..4:
# 1 x 12 = 2 x 6 = 12, runs 1 2 3 4 nodes; batch 24, data-parallel sizes 2 4 6 8. A world size of
# 8 (8 / 2 = 4 is valid, and 8 is in the list) runs 24 // 8 = 3 per rank: micro 1; a world size of
# 12 (12 / 2 = 6 is valid but 12 is not in the list) is refused, as in DeepSpeed.
MODEL_PARALLEL = {"max_train_batch_size": 32, "micro_batch_sizes": [1, 2], "max_gpus": 16,
                  "num_gpus_per_node": 4, "model_parallel_size": 2, "version": 0.2}

TABLE = [
    # (section, world size, batch, valid world sizes, micro-batch or None without a world size)
    (DOCS, 0, 1680, DIVISORS_840, None),
    (DOCS, 8, 1680, DIVISORS_840, 6),      # 1680 / 8 = 210 = 6 x 35
    (DOCS, 7, 1680, DIVISORS_840, 6),      # 240 = 6 x 40
    (DOCS, 5, 1680, DIVISORS_840, 6),      # 336 = 6 x 56
    (DOCS, 56, 1680, DIVISORS_840, 6),     # 30
    (DOCS, 105, 1680, DIVISORS_840, 4),    # 16: 6 does not divide it
    (DOCS, 420, 1680, DIVISORS_840, 4),    # 4
    (DOCS, 840, 1680, DIVISORS_840, 2),    # 2
    (TIE, 0, 18, [1, 2, 3, 6, 9, 18], None),
    (TIE, 9, 18, [1, 2, 3, 6, 9, 18], 1),  # 2 per rank
    (TIE, 6, 18, [1, 2, 3, 6, 9, 18], 3),
    ({**TIE, "prefer_larger_batch": False}, 4, 12, [1, 2, 3, 4, 6, 12], 3),
    (DS_TEST, 64, 9792, [32, 34, 36, 48, 51, 64, 68, 72, 96, 102, 136, 144, 153, 192, 204, 272, 288, 306,
                         408, 576, 612, 816, 1224], 17),
    (NODES, 4, 48, [2, 4, 6, 8, 12], 4),   # 12 per rank
    (NODES, 2, 48, [2, 4, 6, 8, 12], 4),
    (NODES, 12, 48, [2, 4, 6, 8, 12], 4),  # 4 per rank
    (NODES, 10, 60, [10], 2),              # 6 per rank: 4 does not divide it
    (NODES, 3, 60, [3], 4),                # 20 per rank
    (MODEL_PARALLEL, 8, 24, [2, 4, 6, 8], 1),
    (MODEL_PARALLEL, 4, 24, [2, 4, 6, 8], 2),
]


def _config(section: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 99, "elasticity": {"enabled": True, **section}}


@pytest.mark.parametrize("section, world_size, batch, valid, micro", TABLE)
def test_matches_deepspeeds_search(section, world_size, batch, valid, micro):
    got = compute_elastic_config(_config(section), DS, world_size=world_size)
    assert got == ((batch, valid) if micro is None else (batch, valid, micro))
    assert all(isinstance(n, int) for n in (got[0], *got[1]))


@pytest.mark.parametrize("section, world_size, valid", [
    (DOCS, 16, DIVISORS_840), (DOCS, 9, DIVISORS_840), (TIE, 4, [1, 2, 3, 6, 9, 18]),
    (DS_TEST, 128, None), (MODEL_PARALLEL, 12, [2, 4, 6, 8])])
def test_world_size_the_config_does_not_allow(section, world_size, valid):
    with pytest.raises(ElasticityIncompatibleWorldSize, match=f"world size {world_size} is not one") as info:
        compute_elastic_config(_config(section), DS, world_size=world_size)
    assert info.value.world_size == world_size
    if valid is not None:
        assert list(info.value.valid_world_sizes) == valid and str(valid) in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.world_size, again.valid_world_sizes, str(again)) == (world_size, info.value.valid_world_sizes,
                                                                       str(info.value))


def test_version_02_reads_world_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert compute_elastic_config(_config(MODEL_PARALLEL), DS) == (24, [2, 4, 6, 8])
    # 24 // 8 = 3 per rank: of micro-batches 1 and 2 only 1 divides it
    assert compute_elastic_config(_config(MODEL_PARALLEL), DS, return_microbatch=True) == (24, [2, 4, 6, 8], 1)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ElasticityConfigError, match="needs the world size: pass world_size= or set WORLD_SIZE"):
        compute_elastic_config(_config(MODEL_PARALLEL), DS)


def test_return_microbatch_of_version_01_needs_a_world_size():
    with pytest.raises(ValueError, match="needs the world size"):
        compute_elastic_config(_config(DOCS), DS, return_microbatch=True)


def test_search_pieces():
    # bases at or above the limit are their own candidate (the lcm 105 of [3, 5, 7] exceeds 100)
    assert candidate_batch_sizes([3, 5, 7, 105], 100) == {3 * 24, 5 * 12, 7 * 12, 105}
    assert candidate_batch_sizes([1], 10**9) == {720720}  # the largest highly composite number listed
    assert valid_world_sizes(24, [4, 5], 2, 4) == [2, 3]  # 24 / 4 = 6: divisors 2, 3 within [2, 4]


@pytest.mark.parametrize("target", [DS, "0.3.8", "1.0", dsrun.__version__])
def test_target_versions_that_run_elasticity(target):
    assert compute_elastic_config(_config(DOCS), target)[0] == 1680


@pytest.mark.parametrize("target, message", [("0.2", "has no elasticity"), ("0.3.7", "has no elasticity"),
                                             ("latest", "is not a version")])
def test_target_versions_without_elasticity(target, message):
    with pytest.raises(ElasticityError, match=message):
        compute_elastic_config(_config(DOCS), target)


@pytest.mark.parametrize("config, message", [
    ({}, "no 'elasticity' section"),
    ({"elasticity": {"enabled": False, **DOCS}}, "elasticity is disabled"),
    ({"elasticity": {"enabled": True}}, "max_train_batch_size and micro_batch_sizes required"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 100}}, "micro_batch_sizes required"),
    (_config({**DOCS, "micro_batch_sizes": []}), "micro_batch_sizes: expected a non-empty list of positive"),
    (_config({**DOCS, "micro_batch_sizes": [1, 4, -1]}), "micro_batch_sizes: expected a non-empty list"),
    (_config({**DOCS, "micro_batch_sizes": [2, 0.5, 4]}), "micro_batch_sizes: expected a non-empty list"),
    (_config({**DOCS, "micro_batch_sizes": 5}), "micro_batch_sizes: expected a non-empty list"),
    (_config({**DOCS, "micro_batch_sizes": [4000]}), r"\[4000\] exceed max_train_batch_size \(2000\)"),
    (_config({**DOCS, "min_gpus": 8, "max_gpus": 4}), r"max_gpus: max_gpus \(4\) is below min_gpus \(8\)"),
    (_config({**DOCS, "min_gpus": -1}), "min_gpus: expected a positive integer"),
    (_config({**DOCS, "version": 0.3}), "unknown version 0.3"),
    (_config({**DOCS, "model_parallel_size": 4, "num_gpus_per_node": 8}), "model_parallel_size=4 needs version 0.2"),
    (_config({**DOCS, "version": 0.2, "model_parallel_size": 16, "num_gpus_per_node": 8}),
     r"num_gpus_per_node \(8\) is not a multiple of model_parallel_size \(16\)"),
    (_config({**DOCS, "min_gpus": 3000, "max_gpus": 4000}), "no world size from 3000 .* to 4000"),
])
def test_bad_configs(config, message):
    with pytest.raises(ElasticityConfigError, match=message):
        compute_elastic_config(config, DS, world_size=1)


def test_not_a_dict_and_negative_world_size():
    with pytest.raises(ValueError, match="must be a dict"):
        compute_elastic_config("ds_config.json", DS)
    with pytest.raises(ValueError, match="world_size must be an integer >= 0"):
        compute_elastic_config(_config(DOCS), DS, world_size=-2)


def test_enabled_and_importable_as_deepspeed():
    assert elasticity_enabled(_config(DOCS)) and not elasticity_enabled({"elasticity": {"enabled": False}})
    assert not elasticity_enabled({})
    assert dsrun.elasticity.compute_elastic_config is compute_elastic_config
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError)
    assert issubclass(ElasticityConfigError, ElasticityError)


def test_a_loaded_config_and_unknown_keys():
    cfg = load_config({"elasticity": {"enabled": True, **TIE}}, world_size=2)
    assert compute_elastic_config(cfg, DS, world_size=2) == (18, [1, 2, 3, 6, 9, 18], 3)
    with pytest.warns(ConfigWarning, match="unknown keys ignored, as DeepSpeed ignores them: elasticity.auto"):
        assert compute_elastic_config({"elasticity": {"enabled": True, "auto": True, **TIE}}, DS)[0] == 18

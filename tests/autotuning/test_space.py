"""Candidate generation (dsrun/autotuning/space.py) and the search order (search.py)."""
from __future__ import annotations

import pytest

from dsrun.autotuning.search import Search
from dsrun.autotuning.space import (
    BUCKET_SIZES,
    Candidate,
    base_candidate,
    generate,
    micro_batch_sizes,
    spread,
)
from dsrun.runtime.config import load_config
from dsrun.runtime.config.sections import AutotuningConfig


def tuning(**keys) -> AutotuningConfig:
    return AutotuningConfig.model_validate(keys)


def test_micro_batch_sizes_are_powers_of_two_with_both_ends():
    assert micro_batch_sizes(3, 20) == [3, 4, 8, 16, 20]
    assert micro_batch_sizes(1, 1) == [1]
    assert micro_batch_sizes(1, 8) == [1, 2, 4, 8]


def test_fixed_global_batch_is_kept_by_gradient_accumulation():
    cands = generate(tuning(max_train_micro_batch_size_per_gpu=64), {"train_batch_size": 32}, dp_size=2)
    assert {c.stage for c in cands} == {0, 1, 2, 3}
    assert all(c.micro_batch * c.grad_accum * 2 == 32 for c in cands)
    assert sorted({c.micro_batch for c in cands}) == [1, 2, 4, 8, 16]  # 32 and 64 do not divide 32 over 2 ranks


def test_free_global_batch_follows_the_micro_batch_up_to_the_limit():
    cands = generate(tuning(max_train_micro_batch_size_per_gpu=64, max_train_batch_size=64),
                     {"gradient_accumulation_steps": 2}, dp_size=4)
    assert {(c.micro_batch, c.grad_accum) for c in cands} == {(1, 2), (2, 2), (4, 2), (8, 2)}


def test_offload_only_at_stage_one_and_above_and_buckets_only_when_not_fast():
    fast = generate(tuning(max_train_micro_batch_size_per_gpu=2), {}, 1, offload_devices=("none", "cpu"))
    assert {(c.stage, c.offload_optimizer) for c in fast} == {(0, "none"), *((s, d) for s in (1, 2, 3)
                                                                             for d in ("none", "cpu"))}
    assert all(c.reduce_bucket_size is None for c in fast)
    slow = generate(tuning(max_train_micro_batch_size_per_gpu=1, fast=False), {}, 1)
    assert {(c.reduce_bucket_size, c.allgather_bucket_size) for c in slow if c.stage == 2} == \
        {(r, a) for r in BUCKET_SIZES for a in BUCKET_SIZES}
    assert [c for c in slow if c.stage == 0] == [Candidate(0, 1, 1)]


def test_activation_checkpointing_is_tuned_only_with_its_script_flag():
    assert {c.activation_checkpointing for c in generate(tuning(max_train_micro_batch_size_per_gpu=1), {}, 1)} == {None}
    mapped = tuning(max_train_micro_batch_size_per_gpu=1, arg_mappings={"activation_checkpointing": "--ckpt"})
    assert {c.activation_checkpointing for c in generate(mapped, {}, 1)} == {False, True}


def test_candidate_config_loads_with_the_batch_it_names():
    base = {"train_batch_size": 32, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 1, "overlap_comm": True}, "autotuning": {"metric": "latency"}}
    c = Candidate(2, 4, 4, "cpu", 50_000_000, 500_000_000)
    cfg = load_config(c.apply(base, 2), world_size=2)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 4, 32)
    assert cfg.zero_optimization.stage == 2 and cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000 and cfg.zero_optimization.overlap_comm
    assert cfg.autotuning.enabled and cfg.autotuning.metric == "latency"
    assert base["zero_optimization"]["stage"] == 1  # the base is not modified
    assert base_candidate(base, 2, 8, 2) == Candidate(1, 8, 2)


def test_spread_keeps_the_largest_and_evenly_spaced_sizes_per_setting():
    cands = [Candidate(s, m, 1) for s in (0, 1) for m in (1, 2, 4, 8, 16)]
    kept = spread(cands, 3)
    assert [(c.stage, c.micro_batch) for c in kept] == [(0, 1), (0, 4), (0, 16), (1, 1), (1, 4), (1, 16)]
    assert [c.micro_batch for c in spread(cands, 1) if c.stage == 0] == [16]
    assert spread(cands, 10) == cands


def test_search_stops_after_num_trials_and_after_early_stopping():
    cands = [Candidate(0, m, 1) for m in (1, 2, 4, 8, 16)]
    search = Search(cands, "gridsearch", num_trials=2, early_stopping=5)
    assert [search.next(), search.next(), search.next()] == [cands[0], cands[1], None]

    search = Search(cands, "gridsearch", num_trials=50, early_stopping=2)
    tried = []
    for score in (5.0, 4.0, 3.0, 9.0):
        c = search.next()
        if c is None:
            break
        tried.append(c)
        search.record(c, score)
    assert tried == cands[:3] and search.stopped_early


def test_random_order_is_a_seeded_permutation():
    cands = [Candidate(s, m, 1) for s in range(4) for m in (1, 2, 4)]
    orders = []
    for _ in range(2):
        search = Search(cands, "random", num_trials=50, early_stopping=50)
        orders.append([search.next() for _ in cands])
    assert orders[0] == orders[1] and sorted(orders[0]) == sorted(cands) and orders[0] != cands


def test_model_based_search_goes_where_the_fit_points():
    # Throughput grows with the micro-batch size and drops with the stage: after the warm-up
    # trials the model must pick the largest micro-batch at stage 0 next.
    cands = [Candidate(0, 1, 1), Candidate(0, 2, 1), Candidate(1, 1, 1), Candidate(1, 2, 1),
             Candidate(0, 4, 1), Candidate(1, 4, 1), Candidate(0, 16, 1), Candidate(1, 16, 1)]
    truth = {c: 10 * c.micro_batch - 5 * c.stage for c in cands}
    search = Search(cands, "model_based", num_trials=50, early_stopping=50)
    for _ in range(3):
        c = search.next()
        search.record(c, truth[c])
    assert search.next() == Candidate(0, 16, 1)


def test_unknown_tuner_type_is_refused():
    with pytest.raises(ValueError, match="unknown tuner_type 'bayes'"):
        Search([], "bayes", 1, 1)

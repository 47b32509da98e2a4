"""The memory model and pruning (dsrun/autotuning/prune.py) against estimate_zero_memory."""
from __future__ import annotations

from dataclasses import replace

from dsrun.autotuning.prune import (
    HEADROOM,
    MemoryBudget,
    MemoryModel,
    optimizer_states,
    precision,
    prune,
)
from dsrun.autotuning.space import Candidate
from dsrun.runtime.memory.accounting import estimate_zero_memory
from tests.autotuning.helpers import MIB, result

BASE = {"train_batch_size": 32, "optimizer": {"type": "Adam", "params": {}}}


def test_precision_and_optimizer_states_of_a_config():
    assert precision({"bf16": {"enabled": True}}) == "bf16"
    assert precision({"fp16": {"enabled": True}}) == "fp16"
    assert precision({"fp16": {"enabled": False}}) == "fp32"
    assert optimizer_states({"optimizer": {"type": "SGD"}}) == 1 and optimizer_states(BASE) == 2


def test_model_is_fitted_to_the_baseline_and_uses_the_zero_estimate():
    r = result()
    model = MemoryModel.from_baseline(r, Candidate(0, 2, 8), BASE, dp_size=2)
    stage0 = estimate_zero_memory(10_000_000, 2, 0, dtype="fp32", optimizer_states=2).total
    assert model.fixed == 300 * MIB - stage0
    assert model.per_sample == (320 - 300) * MIB // 2
    # The baseline's own prediction at its micro-batch is its measured peak.
    assert model.predict(Candidate(0, 2, 8))["device"] == 320 * MIB
    stage3 = estimate_zero_memory(10_000_000, 2, 3, dtype="fp32", optimizer_states=2).total
    assert model.predict(Candidate(3, 4, 4))["device"] == model.fixed + stage3 + 4 * model.per_sample


def test_cpu_budget_counts_every_rank_of_the_node_and_the_baseline_memory():
    budget = MemoryBudget.from_result(result())
    assert not budget.accelerator
    assert budget.host_per_node == int((1024 + 2 * 300) * MIB * HEADROOM)


def test_candidates_over_the_budget_are_ruled_out_with_the_estimate():
    r = result(host_available=(200 * MIB, 200 * MIB))  # (200 + 2 x 300) MiB x 0.9 for two ranks
    model = MemoryModel.from_baseline(r, Candidate(0, 2, 8), BASE, dp_size=2)
    budget = MemoryBudget.from_result(r)
    cands = [Candidate(0, m, 32 // (2 * m)) for m in (1, 2, 4, 8, 16)] + [Candidate(3, 16, 1)]
    fits, out = prune(cands, model, budget)
    for c in fits:
        assert model.predict(c)["device"] * 2 <= budget.host_per_node
    assert [c for c, _ in out] == [c for c in cands if c not in fits]
    assert fits == [Candidate(0, 1, 16), Candidate(0, 2, 8), Candidate(0, 4, 4)]
    assert all("GiB of RAM per node (2 ranks)" in why for _, why in out)


def test_accelerator_budget_checks_device_and_host_tiers_apart():
    r = replace(result(), device="cuda", device_total=(1024 * MIB, 1024 * MIB), host_available=(50 * MIB,) * 2,
                base_memory=(200 * MIB,) * 2, peak_memory=(220 * MIB,) * 2)
    model = MemoryModel.from_baseline(r, Candidate(0, 2, 8), BASE, dp_size=2)
    budget = MemoryBudget.from_result(r)
    assert budget.accelerator and budget.device_per_rank == int(1024 * MIB * HEADROOM)
    # Offloading the optimizer moves its states (2 x 4 bytes x 5M elements, 38 MiB per rank) to the
    # host: two ranks exceed the node's 45 MiB; on the device the same candidate fits.
    fits, out = prune([Candidate(2, 2, 8), Candidate(2, 2, 8, "cpu")], model, budget)
    assert fits == [Candidate(2, 2, 8)]
    assert "of host memory per node" in out[0][1]

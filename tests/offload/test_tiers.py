"""The offload tiers on one rank (see [Note: optimizer tiers] and [Note: parameter tiers]).

Two levels:
- in this process, without a process group: where each tier places masters,
  gradients and partitions, and the NVMe parameter tier's whole life cycle on
  a real FlatParamSet (swap file reserved, partition moved out, read back on
  demand, nested residency, written back or not, prefetch, removal);
- in one spawned gloo rank (world size 1): the optimizer tiers behind a real
  ZeRO strategy, whose step must give the in-memory step's masters bit for
  bit on host memory and from swap files with 1, 2 or 3 streaming buffers,
  and whose swap files exist while the engine lives and are gone after close.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from dsrun.runtime.offload.optimizer_tier import OptimizerTier
from dsrun.runtime.offload.param_tier import NvmeParamTier, ParamTier
from dsrun.runtime.offload.swap import SwapError, job_name
from dsrun.runtime.optim.precision import PrecisionPolicy
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.groups import RankGroup
from tests.dist_helpers import run_ranks
from tests.zero.models import base_config, train

CUDA = torch.device("cuda", 0)  # only compared, never allocated on
CPU = torch.device("cpu")


def test_optimizer_tier_placement():
    none, host = OptimizerTier(), OptimizerTier(host=True)
    assert (none.master_device(CUDA), none.grad_device(CUDA)) == (CUDA, CUDA)
    assert (host.master_device(CUDA), host.grad_device(CUDA)) == (CPU, CPU)
    # A CPU model: host memory is the device, nothing to move.
    assert (host.master_device(CPU), host.grad_device(CPU)) == (CPU, CPU)
    # Tests name another offload device to see which tensors follow it.
    other = OptimizerTier(host=True, offload_device="meta")
    assert (other.master_device(CPU), other.grad_device(CPU)) == (torch.device("meta"),) * 2
    assert (none.device_kind, host.device_kind) == ("none", "cpu")


def test_param_tier_placement():
    assert ParamTier().partition_device(CUDA) == CUDA
    assert ParamTier(host=True).partition_device(CUDA) == CPU
    assert ParamTier(host=True, offload_device="meta").partition_device(CPU) == torch.device("meta")


# ---- the NVMe parameter tier on a real stage-3 FlatParamSet -------------------------------------------
SHAPES = [(6, 5), (9,), (4, 4)]


def _partitioned_set(seed: int, dtype: torch.dtype = torch.float32) -> FlatParamSet:
    """A stage-3 set (partition_params) of one rank: the partition is the whole flat model."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    return FlatParamSet(f"unit{seed}", [(p, f"p{i}", 0) for i, p in enumerate(params)], RankGroup.alone(),
                        PrecisionPolicy(compute_dtype=dtype, comm_dtype=dtype), None, partition_params=True)


@pytest.fixture
def nvme_tier(tmp_path):
    """An NvmeParamTier holding two sets; yields (tier, sets, their initial partitions, swap directory)."""
    tier = NvmeParamTier(tmp_path, rank=0, buffer_count=1, aio={"block_size": 4096, "queue_depth": 4})
    sets = [_partitioned_set(1), _partitioned_set(2)]
    numels = [torch.Size(s).numel() for s in SHAPES] * 2  # of every parameter the tier will hold
    tier.prepare(SimpleNamespace(precision=sets[0].precision), numels, world_size=1)
    initial = [s.partition.clone() for s in sets]
    for s in sets:
        tier.adopt(s)
    yield tier, sets, initial, tmp_path / job_name() / "rank0.params"
    tier.close()


def _bytes(fset) -> int:
    return fset.partition.untyped_storage().nbytes()


def test_nvme_param_tier_reserves_a_swap_file_and_moves_partitions_out(nvme_tier):
    tier, sets, _initial, swap_dir = nvme_tier
    assert sorted(os.listdir(swap_dir)) == ["params.swp"]
    # Each parameter's share rounded up plus one element of padding, 4 bytes each, for both sets.
    assert (swap_dir / "params.swp").stat().st_size == tier.nvme_bytes() == 2 * (30 + 9 + 16 + 3) * 4
    assert [_bytes(s) for s in sets] == [0, 0]  # adopted: only the swap file holds them
    assert tier.stats["write_bytes"] == 2 * sets[0].partition.numel() * 4


def test_nvme_param_tier_reads_back_on_demand_and_nested_uses_share_one_read(nvme_tier):
    tier, sets, initial, _ = nvme_tier
    before = tier.stats["read_bytes"]
    with tier.resident(sets[1]):
        assert torch.equal(sets[1].partition, initial[1])
        with tier.resident(sets[1]):
            assert torch.equal(sets[1].partition, initial[1])
        assert _bytes(sets[1]) > 0  # still held by the outer block
        assert _bytes(sets[0]) == 0  # the other set stays out
    assert tier.stats["read_bytes"] - before == initial[1].numel() * 4
    assert _bytes(sets[1]) == 0


def test_nvme_param_tier_writes_back_only_when_asked(nvme_tier):
    tier, sets, initial, _ = nvme_tier
    with tier.resident(sets[0]):
        sets[0].partition.add_(1.0)  # a gather only reads: the change is dropped
    with tier.resident(sets[0], write=True):
        assert torch.equal(sets[0].partition, initial[0])
        sets[0].partition.mul_(2.0)
    with tier.resident(sets[0]):
        assert torch.equal(sets[0].partition, initial[0] * 2.0)


def test_nvme_param_tier_step_writes_each_set_back_as_the_next_enters(nvme_tier):
    tier, sets, initial, _ = nvme_tier
    with tier.stepping() as enter:
        enter(sets[0])
        sets[0].partition.sub_(0.5)
        enter(sets[0])  # the same set again: still resident, nothing read or written
        enter(sets[1])
        assert _bytes(sets[0]) == 0  # written back and freed when the next set entered
        sets[1].partition.neg_()
    assert [_bytes(s) for s in sets] == [0, 0]
    tier.materialize(None)
    assert torch.equal(sets[0].partition, initial[0] - 0.5) and torch.equal(sets[1].partition, -initial[1])
    tier.settle(None)
    assert [_bytes(s) for s in sets] == [0, 0]


def test_nvme_param_tier_prefetch_is_used_by_the_next_residency(nvme_tier):
    tier, sets, initial, _ = nvme_tier
    tier.prefetch(sets[0])
    tier.prefetch(sets[1])  # lookahead 1: one read in flight at a time, this one is skipped
    reads = tier.stats["read_bytes"]
    assert reads == initial[0].numel() * 4
    with tier.resident(sets[0]):
        assert torch.equal(sets[0].partition, initial[0])
    assert tier.stats["read_bytes"] == reads  # the prefetched read, not a second one
    with tier.resident(sets[1]):
        assert torch.equal(sets[1].partition, initial[1])


def test_nvme_param_tier_close_removes_the_files(tmp_path):
    tier = NvmeParamTier(tmp_path, rank=0, buffer_count=2, aio={})
    fset = _partitioned_set(3, torch.bfloat16)
    tier.prepare(SimpleNamespace(precision=fset.precision), [30, 9, 16], world_size=1)
    swap_dir = tmp_path / job_name() / "rank0.params"
    assert (swap_dir / "params.swp").stat().st_size == (55 + 3) * 2  # bf16: 2 bytes an element
    tier.adopt(fset)
    tier.close()
    assert not swap_dir.exists() and os.listdir(tmp_path) == []


def test_nvme_param_tier_refuses_a_missing_path(tmp_path):
    tier = NvmeParamTier(tmp_path / "absent", rank=0, buffer_count=1, aio={})
    with pytest.raises(SwapError, match="offload_param.nvme_path"):
        tier.prepare(SimpleNamespace(precision=PrecisionPolicy()), [10], world_size=1)


# ---- the optimizer tiers behind a real strategy, one gloo rank ----------------------------------------
def _config(stage: int, prec: str, device: str, path: str, buffer_count: int = 3) -> dict:
    off = {"device": device}
    if device == "nvme":
        off.update(nvme_path=path, buffer_count=buffer_count)
    return base_config(stage, prec, sub_group_size=120, reduce_bucket_size=300, offload_optimizer=off,
                       stage3_param_persistence_threshold=40)


def _optimizer_tiers(path: str) -> dict:
    out = {}
    for stage, prec in ((2, "fp32"), (2, "bf16"), (3, "bf16")):
        for device, buffers in (("none", 0), ("cpu", 0), ("nvme", 1), ("nvme", 2), ("nvme", 3)):
            losses, full, engine = train(_config(stage, prec, device, path, buffers), steps=3, optimizer="config")
            strategy = engine.strategy
            tier = strategy.optimizer_tier
            case = {"losses": losses, "full": full, "kind": tier.device_kind, "tier": type(tier).__name__,
                "masters": {str(f.master.device) if f.master is not None else None for f in strategy.sets},
                "grads": {str(f.grad_partition.device) for f in strategy.sets}}
            if device == "nvme":
                strategy._settle()  # train() read the full masters: back into the files
                case.update(files=sorted(os.listdir(tier.swap.path)), buffers=len(tier._buffers),
                            file_bytes=sum(f.stat().st_size for f in tier.swap.files.values()),
                            held_in_memory=[f.master is not None for f in strategy.sets])
                swap = tier.swap.path
                tier.close()
                case["removed"] = not swap.exists()
            out[(stage, prec, device, buffers)] = case
    return out


@pytest.fixture(scope="module")
def optimizer_tiers(tmp_path_factory):
    path = tmp_path_factory.mktemp("nvme")
    (out,) = run_ranks(_optimizer_tiers, 1, str(path), timeout=400)
    return out, path


@pytest.mark.parametrize("stage,prec", [(2, "fp32"), (2, "bf16"), (3, "bf16")])
def test_a_step_from_host_memory_or_swap_files_equals_the_in_memory_step(optimizer_tiers, stage, prec):
    out, _ = optimizer_tiers
    ref = out[(stage, prec, "none", 0)]
    for device, buffers in (("cpu", 0), ("nvme", 1), ("nvme", 2), ("nvme", 3)):
        case = out[(stage, prec, device, buffers)]
        assert case["losses"] == ref["losses"], (device, buffers)
        assert all(torch.equal(case["full"][n], ref["full"][n]) for n in ref["full"]), (device, buffers)
        assert case["kind"] == device
    assert len(set(ref["losses"])) > 1  # it trained


def test_tier_kinds_and_placement_on_a_cpu_model(optimizer_tiers):
    out, _ = optimizer_tiers
    assert out[(2, "fp32", "none", 0)]["tier"] == out[(2, "fp32", "cpu", 0)]["tier"] == "OptimizerTier"
    assert out[(2, "fp32", "nvme", 3)]["tier"] == "NvmeOptimizerTier"
    for key, case in out.items():
        assert case["grads"] == {"cpu"}, key  # a CPU model: host memory is the device memory
        if key[2] == "nvme":  # masters in the file once settled (train() materialized them to read them)
            assert case["held_in_memory"] == [False] * len(case["held_in_memory"]), key
        else:  # a separate fp32 master only for 16-bit compute
            assert case["masters"] == ({"cpu"} if key[1] == "bf16" else {None}), key


def test_swap_files_follow_the_precision_and_are_removed(optimizer_tiers):
    out, path = optimizer_tiers
    for (stage, prec, device, buffers), case in out.items():
        if device != "nvme":
            continue
        want = ["exp_avg.swp", "exp_avg_sq.swp"] + (["master.swp"] if prec == "bf16" else [])
        assert case["files"] == want
        assert case["file_bytes"] > 0 and case["removed"]
        assert 1 <= case["buffers"] <= buffers  # never more streaming buffers than asked for
    assert os.listdir(path) == []

"""offload_optimizer cpu / nvme at stages 1-3 against no offload, on 2 real gloo ranks.

The offloaded step runs the same dsrun CPU Adam on the same elements (only
where masters and moments live differs, see [Note: optimizer tiers]), so
losses and the final fp32 masters must equal no offload bit for bit, in
fp32, bf16 and fp16. One spawn runs the whole matrix.
"""
import os

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.zero.models import base_config, train

CASES = [(stage, prec) for prec in ("fp32", "bf16") for stage in (1, 2, 3)] + [(2, "fp16"), (3, "fp16")]


def _config(stage, prec, device, path, **extra):
    off = {"device": device}
    if device == "nvme":
        off.update(nvme_path=path, buffer_count=3)
    cfg = base_config(stage, prec, gas=2, sub_group_size=100, reduce_bucket_size=300,
                      stage3_param_persistence_threshold=0, offload_optimizer=off, **extra)
    cfg["gradient_clipping"] = 1.0
    return cfg


def _matrix(path):
    out = {}
    for stage, prec in CASES:
        for device in ("none", "cpu", "nvme"):
            losses, full, engine = train(_config(stage, prec, device, path), steps=3, optimizer="config")
            tier = engine.strategy.optimizer_tier
            swap = tier.swap.path if device == "nvme" else None
            out[(stage, prec, device)] = dict(
                losses=losses, full=full, breakdown=engine.memory_breakdown(),
                swap_files=sorted(os.listdir(swap)) if swap else None,
                read=tier.stats.get("read_bytes", 0), kind=tier.device_kind)
            tier.close()
            if swap:
                out[(stage, prec, device)]["removed"] = not swap.exists()
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    path = tmp_path_factory.mktemp("nvme")
    results = run_ranks(_matrix, 2, str(path), timeout=600)
    return results, path


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("stage,prec", CASES)
def test_losses_and_masters_equal_no_offload(matrix, stage, prec, device):
    results, _ = matrix
    for rank_out in results:
        base, off = rank_out[(stage, prec, "none")], rank_out[(stage, prec, device)]
        assert off["kind"] == device
        assert off["losses"] == base["losses"]
        assert off["losses"][-1] < off["losses"][0]
        for name, value in base["full"].items():
            assert torch.equal(off["full"][name], value), name


def test_nvme_states_live_in_swap_files(matrix):
    results, path = matrix
    for rank, rank_out in enumerate(results):
        for stage, prec in CASES:
            nvme = rank_out[(stage, prec, "nvme")]
            want = ["exp_avg.swp", "exp_avg_sq.swp"] + (["master.swp"] if prec != "fp32" else [])
            assert nvme["swap_files"] == sorted(want)
            assert nvme["read"] > 0  # the last step streamed its states from the files
            assert nvme["breakdown"]["nvme_swap"]["fp32"] > 0
            assert nvme["removed"]
    assert os.listdir(path) == []  # every rank's directory and the job directory are gone

"""offload_optimizer cpu / nvme at stages 1-3 and offload_param cpu / nvme at
stage 3 against no offload, on 2 real gloo ranks.

The offloaded step runs the same dsrun CPU Adam on the same elements (only
where masters, moments and partitions live differs, see [Note: optimizer
tiers] and [Note: parameter tiers]), so losses and the final fp32 masters
must equal no offload bit for bit, in fp32, bf16 and fp16. One spawn runs
the whole matrix.
"""
import os

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.zero.models import base_config, train

CASES = [(stage, prec) for prec in ("fp32", "bf16") for stage in (1, 2, 3)] + [(2, "fp16"), (3, "fp16")]
# Stage 3 parameter offload: (name, offload_optimizer.device, offload_param.device).
PARAM_CASES = [("param_cpu", "none", "cpu"), ("param_nvme", "none", "nvme"), ("both_cpu", "cpu", "cpu"),
               ("both_nvme", "nvme", "nvme")]


def _config(stage, prec, device, path, param_device="none"):
    off = {"device": device}
    if device == "nvme":
        off.update(nvme_path=path, buffer_count=3)
    cfg = base_config(stage, prec, gas=2, sub_group_size=100, reduce_bucket_size=300,
                      stage3_param_persistence_threshold=40, stage3_prefetch_bucket_size=600,
                      stage3_max_live_parameters=1500, offload_optimizer=off,
                      **({"offload_param": {"device": param_device, "nvme_path": path, "buffer_count": 2}}
                         if stage == 3 else {}))
    cfg["gradient_clipping"] = 1.0
    return cfg


def _estimate(engine, prec, opt, param):
    import dsrun

    sets = engine.strategy.sets
    est = dsrun.estimate_zero_memory(engine.module, 2, 3, prec, offload_optimizer=opt, offload_param=param,
                                     padded_numel=sum(f.layout.padded_numel for f in sets),
                                     sub_group_size=100, buffer_count=3)
    return est.tiers(), est.categories, sum(len(f.layout.slots) for f in sets)


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
    # ratio 0.5: half the states stay in memory, the rest are streamed.
    for prec in ("fp32", "bf16"):
        cfg = _config(3, prec, "nvme", path)
        cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
        losses, full, engine = train(cfg, steps=3, optimizer="config")
        engine.strategy._settle()
        tier = engine.strategy.optimizer_tier
        out[(3, prec, "ratio")] = dict(losses=losses, full=full, kept=sum(g.hi - g.lo for g, _ in tier._kept),
                                       streamed=sum(g.hi - g.lo for g in tier._groups),
                                       states=engine.memory_breakdown()["optimizer_states"]["fp32"])
        tier.close()
    # A torch optimizer: refused with offload unless zero_force_ds_cpu_optimizer is false.
    try:
        train(_config(2, "fp32", "cpu", path), steps=1, optimizer="adamw")
        out["client_refused"] = None
    except ValueError as e:
        out["client_refused"] = str(e)
    allowed = {**_config(2, "fp32", "cpu", path), "zero_force_ds_cpu_optimizer": False}
    out["client_cpu"] = train(allowed, steps=3, optimizer="adamw")[:2]
    out["client_none"] = train(_config(2, "fp32", "none", path), steps=3, optimizer="adamw")[:2]
    for prec in ("fp32", "bf16"):
        for name, opt, param in PARAM_CASES:
            losses, full, engine = train(_config(3, prec, opt, path, param), steps=3, optimizer="config")
            tier = engine.strategy.param_tier
            engine.strategy._settle()  # train() read full masters: back to the swap files
            breakdown = engine.memory_breakdown()
            out[(3, prec, name)] = dict(losses=losses, full=full, kind=tier.device_kind,
                                        read=getattr(tier, "stats", {}).get("read_bytes", 0),
                                        nvme=breakdown.get("nvme_swap", {}).get("fp32", 0), breakdown=breakdown,
                                        estimate=_estimate(engine, prec, opt, param))
            engine.strategy.optimizer_tier.close()
            tier.close()
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


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
@pytest.mark.parametrize("name,opt,param", PARAM_CASES)
def test_param_offload_equals_no_offload(matrix, prec, name, opt, param):
    results, _ = matrix
    for rank_out in results:
        base, off = rank_out[(3, prec, "none")], rank_out[(3, prec, name)]
        assert off["kind"] == param
        assert off["losses"] == base["losses"]
        for n, value in base["full"].items():
            assert torch.equal(off["full"][n], value), n
        if param == "nvme":
            assert off["read"] > 0 and off["nvme"] > 0  # partitions were read back from params.swp


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_estimate_matches_offloaded_engine(matrix, prec):
    """estimate_zero_memory's NVMe bytes are the swap files' (which reserve at
    most one more element per parameter and file), its host buffers the
    optimizer tier's, and nothing of the optimizer is left in memory."""
    results, _ = matrix
    for rank_out in results:
        run = rank_out[(3, prec, "both_nvme")]
        tiers, cats, nparams = run["estimate"]
        files = 3 if prec == "bf16" else 2  # master (16-bit runs), exp_avg, exp_avg_sq; params.swp apart
        elt = 2 if prec == "bf16" else 4
        assert tiers["nvme"] <= run["nvme"] <= tiers["nvme"] + nparams * (4 * files + elt) + 2 * 4 * files
        page_padding = 3 * 4096  # each buffer starts on a page boundary
        assert run["breakdown"]["offload_buffers"]["fp32"] <= cats["offload_buffers"]["fp32"] + page_padding
        assert "master" not in run["breakdown"] or not run["breakdown"]["master"]
        assert not run["breakdown"].get("optimizer_states")


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_ratio_keeps_part_in_memory_with_the_same_losses(matrix, prec):
    results, _ = matrix
    for rank_out in results:
        base, run = rank_out[(3, prec, "none")], rank_out[(3, prec, "ratio")]
        assert run["losses"] == base["losses"]
        assert all(torch.equal(run["full"][n], v) for n, v in base["full"].items())
        total = run["kept"] + run["streamed"]
        assert run["kept"] > 0 and run["streamed"] > 0 and abs(run["kept"] - total / 2) <= 100  # sub_group_size
        assert run["states"] == 2 * 4 * run["kept"]  # only the kept moments are in memory


def test_client_optimizer_needs_zero_force_ds_cpu_optimizer_false(matrix):
    results, _ = matrix
    for rank_out in results:
        assert "zero_force_ds_cpu_optimizer" in rank_out["client_refused"]
        (losses, full), (base_losses, base_full) = rank_out["client_cpu"], rank_out["client_none"]
        assert losses == base_losses  # torch's AdamW on host masters: the same arithmetic
        assert all(torch.equal(full[n], base_full[n]) for n in full)


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

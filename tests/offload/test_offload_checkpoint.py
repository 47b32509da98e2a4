"""Checkpoints with offload on are the same format as without: save with
offload_optimizer nvme/cpu and load without it, and the reverse, then keep
training: the losses continue exactly as in the run that saved."""
import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.zero.models import TinyGPT, base_config, batches, param_groups


def _engine(stage, device, nvme):
    import dsrun

    torch.manual_seed(0)
    model = TinyGPT()
    opt, _, param = device.partition("+")  # "nvme+nvme": optimizer and parameters on NVMe
    extra = {"offload_param": {"device": param, "nvme_path": nvme}} if param else {}
    cfg = base_config(stage, "bf16", sub_group_size=150, stage3_param_persistence_threshold=0,
                      offload_optimizer={"device": opt, "nvme_path": nvme}, **extra)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    return dsrun.initialize(model=model, model_parameters=param_groups(model), config=cfg)[0]


def _steps(engine, data):
    out = []
    for idx, tgt in data:
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _resume(stage, save_dev, load_dev, nvme, ckpt):
    """Train 2 steps with `save_dev`, save, train 2 more; a fresh engine with
    `load_dev` loads the checkpoint and trains the same 2 steps."""
    first = _engine(stage, save_dev, nvme)
    data = batches(first.global_rank, 4, 2, 1)
    _steps(first, data[:2])
    first.save_checkpoint(ckpt, tag="t")
    expected = _steps(first, data[2:])
    exp_avg = {n: first.strategy.full_optimizer_state(p, "exp_avg") for n, p in first.module.named_parameters()}
    second = _engine(stage, load_dev, nvme)
    second.load_checkpoint(ckpt, tag="t")
    got = _steps(second, data[2:])
    got_avg = {n: second.strategy.full_optimizer_state(p, "exp_avg") for n, p in second.module.named_parameters()}
    return expected, got, all(torch.equal(exp_avg[n], got_avg[n]) for n in exp_avg)


CASES = [(3, "nvme", "none"), (3, "none", "nvme"), (2, "nvme", "cpu"), (1, "cpu", "nvme"),
         (3, "nvme+nvme", "none"), (3, "none", "cpu+nvme")]


def _all_cases(nvme, ckpt):
    return {case: _resume(*case, nvme, f"{ckpt}/{'-'.join(map(str, case))}") for case in CASES}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload_ckpt")
    (tmp / "nvme").mkdir()
    return run_ranks(_all_cases, 2, str(tmp / "nvme"), str(tmp / "ckpt"), timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}-to-{c[2]}")
def test_resume_across_offload_settings(resumed, case):
    for rank_out in resumed:
        expected, got, same_states = rank_out[case]
        assert got == expected
        assert same_states

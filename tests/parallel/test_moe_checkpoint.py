"""Mixture-of-Experts checkpoints by global expert id (dsrun/runtime/parallel/expert/names.py):
saved at ep_size 2 on 4 ranks, loaded at ep_size 1 and 4 and into the model
without expert parallelism, bit for bit; training then goes on alike."""
from __future__ import annotations

import pytest

from tests.dist_helpers import run_ranks
from tests.parallel.test_moe import HIDDEN, _make_experts_distinct, _Net


def _engine(ep: int, initial: dict, stage: int):
    """An engine over _Net(ep) holding the global weights `initial` (its
    experts: this rank's slice of them)."""
    import dsrun
    from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from dsrun.runtime.parallel.expert.names import global_expert_name
    from dsrun.runtime.parallel.mesh import current
    import torch
    torch.manual_seed(1)
    net = _Net(ep)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(initial[global_expert_name(name, p, current())])  # the mesh the layers were built on
    params = split_params_into_different_moe_groups_for_optimizer({"params": net.parameters(), "name": "parameters"})
    engine, *_ = dsrun.initialize(model=net, model_parameters=params, config={
        "train_micro_batch_size_per_gpu": 12, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.1, "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64}})
    return engine


def _step(engine, step: int) -> float:
    import torch
    import torch.distributed as dist
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    loss = engine(torch.randn(12, HIDDEN, generator=gen), torch.randn(12, generator=gen))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def _global_params(engine) -> dict:
    """Every rank's parameters by global name (full fp32 values; collective)."""
    import torch.distributed as dist
    from dsrun.runtime.parallel.expert.names import global_expert_name
    strategy, mine = engine.strategy, {}
    for name, p in engine.module.named_parameters():
        full = strategy.full_fp32_param(p).reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape) \
            if strategy.manages(p) else p.detach()
        mine[global_expert_name(name, p, engine.mesh)] = full.clone()
    out: dict = {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for part in gathered:
        out.update(part)
    return out


def _round_trip(save_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    import dsrun
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    dsrun.init_distributed()
    torch.manual_seed(0)
    full = _Net(1)
    _make_experts_distinct(full.moe.deepspeed_moe.experts, 7)  # every global expert differs
    initial = {n: p.detach().clone() for n, p in full.named_parameters()}
    out = {}
    for save_stage, loads in ((0, ((1, 2), (4, 3))), (2, ((1, 0), (4, 1)))):
        tag = f"z{save_stage}"
        engine = _engine(2, initial, save_stage)
        for step in range(2):
            _step(engine, step)
        engine.save_checkpoint(save_dir, tag=tag)
        saved = _global_params(engine)
        want_next = _step(engine, 2)
        engine.destroy()
        for ep, stage in loads:
            engine = _engine(ep, initial, stage)
            engine.load_checkpoint(save_dir, tag=tag)
            got = _global_params(engine)
            out[f"{tag}->ep{ep}z{stage}"] = (
                sorted(got) == sorted(saved) and all(torch.equal(got[n], saved[n]) for n in saved),
                _step(engine, 2), want_next)
            engine.destroy()
        if dist.get_rank() == 0:  # the model without expert parallelism, through zero_to_fp32
            plain = _Net(1)
            plain.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag))
            out[f"{tag}->plain"] = all(torch.equal(p, saved[n]) for n, p in plain.named_parameters())
        dist.barrier()
    return out


def test_checkpoint_at_ep2_loads_at_ep1_ep4_and_without_expert_parallelism(tmp_path):
    """World 4: saved at ep=2 (ZeRO 0 and 2), loaded at ep=1 and ep=4 at
    other stages: every parameter by global name equal bit for bit to the
    saved one; the next step's loss equal to the saving run's to 1e-5
    (optimizer states resharded too; float rounding of the reductions)."""
    results = run_ranks(_round_trip, 4, str(tmp_path), timeout=300)
    assert results[0]["z0->plain"] is True and results[0]["z2->plain"] is True
    for r in results:
        for key, value in r.items():
            if key.endswith("plain"):
                continue
            exact, loss, want = value
            assert exact, key
            assert loss == pytest.approx(want, rel=1e-5), key


def _export_16bit(save_dir: str) -> dict:
    """At ep=2 (ZeRO 0 and 3): train a step, save_16bit_model, load the file
    strictly into _Net(1) and compare the loss on this rank's samples."""
    import os

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    import dsrun
    dsrun.init_distributed()
    torch.manual_seed(0)
    full = _Net(1)
    _make_experts_distinct(full.moe.deepspeed_moe.experts, 7)
    initial = {n: p.detach().clone() for n, p in full.named_parameters()}
    out = {}
    for stage in (0, 3):
        engine = _engine(2, initial, stage)
        _step(engine, 0)
        engine.save_16bit_model(save_dir, f"z{stage}.safetensors")
        consolidated = engine._zero3_consolidated_16bit_state_dict()  # the same gathering, into memory on rank 0
        gen = torch.Generator().manual_seed(77 + dist.get_rank())
        x, y = torch.randn(12, HIDDEN, generator=gen), torch.randn(12, generator=gen)
        with torch.no_grad():
            want = float(engine(x, y))
        engine.destroy()
        state = load_file(os.path.join(save_dir, f"z{stage}.safetensors"))
        plain = _Net(1)
        plain.load_state_dict(state, strict=True)
        with torch.no_grad():
            got = float(plain(x, y))
        experts = sorted({n.split(".deepspeed_experts.")[1].split(".")[0] for n in state if "deepspeed_experts" in n})
        out[stage] = (got, want, experts,
                      consolidated is None or all(torch.equal(consolidated[n], state[n]) for n in state)
                      and sorted(consolidated) == sorted(state))
    return out


def test_save_16bit_model_at_ep2_is_the_plain_models_state_dict(tmp_path):
    """2 ranks, ep=2: the 16-bit file holds all 4 experts by global id, loads
    strictly into the model built with ep_size=1 and gives each rank's loss
    to 1e-6 (ZeRO 0 and 3); _zero3_consolidated_16bit_state_dict holds the
    same tensors."""
    for per_rank in run_ranks(_export_16bit, 2, str(tmp_path), timeout=180):
        for stage, (got, want, experts, consolidated) in per_rank.items():
            assert experts == ["0", "1", "2", "3"] and consolidated, stage
            assert got == pytest.approx(want, rel=1e-6), stage

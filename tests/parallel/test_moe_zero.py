"""Mixture of Experts under ZeRO 1-3 and 16-bit precision (dsrun/runtime/zero/experts.py):
expert-parallel training against the same model with all experts local on
every rank, on 2 and 4 gloo ranks."""
from __future__ import annotations

import math
import re

import pytest

from tests.dist_helpers import run_ranks
from tests.parallel.test_moe import _train

# fp32 tolerance: the stages sum the same gradients in another order
# (reduce-scatter over the expert-data group vs all-reduce), so losses and
# norms agree to float rounding, not bit for bit.
RTOL = 1e-5


def _stage(stage: int, **more) -> dict:
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64}, **more}


def _stages(ep: int) -> dict:
    import dsrun
    dsrun.init_distributed()
    want = _train(1, None)
    initial = want[2]
    out = {"want": want[:2]}
    for stage in (1, 2, 3):
        out[f"ep{ep}-z{stage}"] = _train(ep, initial, _stage(stage))[:2]
    out["ep1-z3"] = _train(1, initial, _stage(3))[:2]
    return out


def _check(results: list[dict]) -> None:
    want_loss, want_norm = results[0]["want"]
    assert want_loss[-1] < want_loss[0]
    for key, (loss, norm) in results[0].items():
        assert loss == pytest.approx(want_loss, rel=RTOL), key
        assert norm == pytest.approx(want_norm, rel=RTOL), key
    assert all(r == results[0] for r in results)  # every rank saw the same losses and norms


def test_zero_1_2_3_ep2_on_2_ranks_equals_all_experts_local():
    """ep=2 on 2 ranks (expert-data groups of one rank) at ZeRO 1, 2, 3:
    losses and clipped-step norms equal the ep=1 model at stage 0."""
    _check(run_ranks(_stages, 2, 2, timeout=240))


def test_zero_1_2_3_ep2_by_data2_on_4_ranks_equals_all_experts_local():
    """ep=2 x expert-data=2 on 4 ranks at ZeRO 1, 2, 3 (expert partitions
    over 2 ranks, dense ones over 4) against ep=1 at stage 0."""
    _check(run_ranks(_stages, 4, 2, timeout=300))


def _sixteen_bit() -> dict:
    import torch
    import torch.distributed as dist

    import dsrun
    from tests.parallel.test_moe import _Net
    dsrun.init_distributed()
    out = {"fp32": _train(2, None, _stage(2))[:2]}
    for stage in (0, 2, 3):
        out[f"bf16-z{stage}"] = _train(2, None, _stage(stage, bf16={"enabled": True}))[:2]
    # fp16: an inf in one expert gradient on rank 1 only skips the step on every rank.
    torch.manual_seed(0)
    net = _Net(2)
    if dist.get_rank() == 1:
        weight = net.moe.deepspeed_moe.experts.deepspeed_experts[0][0].weight
        weight.register_hook(lambda g: g * float("inf"))
    engine, *_ = dsrun.initialize(model=net, model_parameters=list(net.parameters()), config={
        "train_micro_batch_size_per_gpu": 12, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "fp16": {"enabled": True, "initial_scale_power": 8}, **_stage(2)})
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(12, 8, generator=gen).half(), torch.randn(12, generator=gen).half()
    engine.backward(engine(x, y))
    engine.step()
    out["fp16"] = (engine.skipped_steps, engine.strategy.loss_scale())
    engine.destroy()
    return out


def test_bf16_trains_and_fp16_overflow_in_one_expert_skips_on_every_rank():
    results = run_ranks(_sixteen_bit, 2, timeout=240)
    want_loss = results[0]["fp32"][0]
    for key in ("bf16-z0", "bf16-z2", "bf16-z3"):
        loss, norm = results[0][key]
        assert all(math.isfinite(v) for v in loss + norm), key
        assert loss == pytest.approx(want_loss, rel=1e-2), key  # bf16 rounding over 4 steps
        assert results[1][key] == results[0][key], key
    # Rank 0's own gradients are finite: it skips only because the expert norm crossed the expert-parallel group.
    assert [r["fp16"][0] for r in results] == [1, 1]


def test_moe_refuses_zero_features_bound_to_the_whole_data_axis():
    import dsrun
    from dsrun.runtime.config import ConfigError
    from tests.parallel.test_moe import _Net
    with pytest.raises(ConfigError, match=re.escape("Mixture-of-Experts layers (expert parallelism) with "
                                                    "zero_optimization.offload_optimizer.device='cpu' is not "
                                                    "supported")):
        dsrun.initialize(model=_Net(1), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})


def test_stage3_refuses_a_unit_mixing_experts_and_dense_parameters():
    """The MoE layer marked as a z3 leaf module puts its experts in the unit
    above it, with dense parameters (none persistent here): their partitions
    would need two groups."""
    import dsrun
    from dsrun.moe.layer import MoE
    from dsrun.runtime.config import ConfigError
    from dsrun.runtime.zero.module_hints import set_z3_leaf_modules
    from tests.parallel.test_moe import _Net
    net = _Net(1)
    set_z3_leaf_modules(net, [MoE])
    with pytest.raises(ConfigError, match="unit '.*' holds parameters of different expert groups"):
        dsrun.initialize(model=net, config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})

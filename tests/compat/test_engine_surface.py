"""The engine methods DeepSpeed scripts and Hugging Face call (DeepSpeedEngineCompat)."""
from __future__ import annotations

import pytest
import torch

import dsrun as deepspeed
from tests.dist_helpers import run_ranks


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])
        self.checkpointing = False

    def gradient_checkpointing_enable(self):
        self.checkpointing = True

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _engine(**config):
    model = _Model()
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **config})
    return engine, model


@pytest.mark.parametrize("precision,stage", [("fp16", 1), ("bf16", 3), (None, 0)])
def test_queries_answer_from_the_config(precision, stage):
    config = {"zero_optimization": {"stage": stage}}
    if precision:
        config[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    engine, _ = _engine(**config)
    assert engine.fp16_enabled() is (precision == "fp16") and engine.bfloat16_enabled() is (precision == "bf16")
    assert engine.zero_optimization_stage() == stage and engine.zero_optimization() is (stage > 0)
    assert engine.zero_optimization_partition_weights() is (stage == 3)
    assert engine.loss_scale() == (2.0 ** 8 if precision == "fp16" else 1.0)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, None: torch.float32}[precision]
    assert engine.get_data_types() == (dtype, torch.float32)
    assert engine.config.get("zero_optimization", {}).get("stage") == stage
    assert engine.config["optimizer"]["type"] == "AdamW" and engine.config.get("nonexistent", 5) == 5
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    assert engine.optimizer_name() == "AdamW" and engine.dp_world_size == 1


def test_attributes_forward_to_the_module_and_train_eval_propagate():
    engine, model = _engine()
    engine.gradient_checkpointing_enable()
    assert model.checkpointing and engine.checkpointing is True
    engine.eval()
    assert not model.training and not model.layers[0].training
    engine.train()
    assert model.training
    with pytest.raises(AttributeError, match="neither the dsrun engine nor its module"):
        engine.no_such_attribute  # noqa: B018
    assert isinstance(engine, deepspeed.DeepSpeedEngine)


def _consolidated() -> dict:
    import dsrun as deepspeed
    torch.manual_seed(0)
    reference = _Model()
    expected = {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}
    engine, *_ = deepspeed.initialize(model=_Model(), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            engine.module.load_state_dict({k: v.float() for k, v in reference.state_dict().items()})
    state = engine._zero3_consolidated_16bit_state_dict()
    if state is None:
        return {"none": True}
    return {"keys": sorted(state), "equal": all(torch.equal(state[k], expected[k]) for k in expected),
            "dtypes": sorted({str(v.dtype) for v in state.values()})}


def test_zero3_consolidated_16bit_state_dict_on_two_ranks():
    r0, r1 = run_ranks(_consolidated, 2, timeout=120)
    assert r1 == {"none": True}  # as DeepSpeed: rank 0 gets the dict
    assert r0["keys"] == ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]
    assert r0["equal"] and r0["dtypes"] == ["torch.bfloat16"]

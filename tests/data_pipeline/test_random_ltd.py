"""Random layerwise token dropping (dsrun.runtime.data_pipeline.data_routing): the
kept-token schedule, the dropping layer, the plain state dict, and an engine run."""
from __future__ import annotations

import copy
import math
import warnings
import sys
from pathlib import Path

import pytest
import torch

from dsrun.runtime.config import ConfigError, load_config
from dsrun.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop, slice_mask
from dsrun.runtime.data_pipeline.data_routing.config import RandomLTDConfig
from dsrun.runtime.data_pipeline.data_routing.helper import (
    convert_to_random_ltd,
    random_ltd_scheduler,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
from dsrun.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler, fixed_linear_value
from tests.dist_helpers import run_ranks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BATCH, SEQ, WIDTH = 3, 16, 8


def _ltd(**over) -> dict:
    ltd = {"enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
           "model_mask_name": None, "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
           "random_ltd_schedule": {"min_value": 4, "max_value": SEQ, "schedule_type": "fixed_linear",
                                   "schedule_config": {"require_steps": 6, "seq_per_step": 2}}}
    ltd.update(over)
    return ltd


def _config(ltd: dict | None = None, **top) -> dict:
    return {"train_batch_size": 4, **top,
            "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd or _ltd()}}}


def _scheduler(**over) -> RandomLTDScheduler:
    return random_ltd_scheduler(load_config(_config(_ltd(**over))))


class _Recorder(torch.nn.Module):
    """A layer that records the shape of what it is given: (B, T, C) -> (B, T, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.seen: list[tuple[int, ...]] = []
        self.masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.seen.append(tuple(x.shape))
        if attention_mask is not None:
            self.masks.append(attention_mask)
        return x + self.lin(x)


class _Stack(torch.nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Recorder() for _ in range(layers))
        self.out = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _bound_stack(scheduler: RandomLTDScheduler) -> _Stack:
    from dsrun.runtime.data_pipeline.data_routing.helper import bind_random_ltd_layers

    torch.manual_seed(0)
    model = convert_to_random_ltd(_Stack(), _Recorder)
    bind_random_ltd_layers(model, scheduler)
    return model


# -- the schedule ------------------------------------------------------------------------------

def _deepspeed_formula(step, lo, hi, require, per):
    """DeepSpeed's `__fixed_root_get_value` with root_degree 1, written out."""
    value = math.floor((float(step) / require) ** 1.0 * (hi - lo) + lo)
    value -= value % per
    return min(value, hi)


@pytest.mark.parametrize("lo,hi,require,per", [(4, 16, 6, 2), (128, 2048, 200, 16), (100, 1000, 37, 16),
                                               (5, 9, 3, 4)])
def test_schedule_table_matches_formula(lo, hi, require, per):
    table = [fixed_linear_value(s, lo, hi, require, per) for s in range(2 * require + 5)]
    assert table == [_deepspeed_formula(s, lo, hi, require, per) for s in range(2 * require + 5)]
    assert table == sorted(table) and table[-1] == hi
    assert all(v % per == 0 or v == hi for v in table)


def test_scheduler_follows_steps_counts_layer_tokens_and_round_trips():
    sched = _scheduler()
    values = []
    for step in range(9):
        sched.update_seq(step)
        sched.update_seq(step)  # a step is counted once
        values.append(sched.get_current_seq())
    assert values == [4, 6, 8, 10, 12, 14, 16, 16, 16]
    # global batch 4 x (kept x 2 dropping layers + 16 x 2 other layers), per step
    assert sched.state["consumed_layer_tokens"] == sum(4 * (v * 2 + 16 * 2) for v in values)
    assert sched.get_total_layer_tokens(9) == sched.state["consumed_layer_tokens"]
    resumed = _scheduler()
    resumed.load_state_dict(copy.deepcopy(sched.state_dict()))
    assert resumed.state_dict() == sched.state_dict() and resumed.get_current_seq() == 16


# -- the dropping layer ------------------------------------------------------------------------

def test_layers_keep_the_scheduled_number_of_tokens():
    sched = _scheduler()
    model = _bound_stack(sched)
    recorders = [w.random_ltd_layer for w in model.layers]
    for step in (0, 2, 5, 6, 10):
        sched.update_seq(step)
        for r in recorders:
            r.seen.clear()
        model(torch.randn(BATCH, SEQ, WIDTH))
        kept = fixed_linear_value(step, 4, SEQ, 6, 2)
        assert [r.seen for r in recorders] == [[(BATCH, SEQ, WIDTH)], [(BATCH, kept, WIDTH)],
                                               [(BATCH, kept, WIDTH)], [(BATCH, SEQ, WIDTH)]]
    model.eval()
    sched.set_current_seq(4)
    for r in recorders:
        r.seen.clear()
    model(torch.randn(BATCH, SEQ, WIDTH))
    assert all(r.seen == [(BATCH, SEQ, WIDTH)] for r in recorders)


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_dropped_tokens_pass_unchanged_and_gradients_split(order):
    sched = _scheduler(hidden_state_order=order)
    sched.update_seq(1)  # 6 of 16 kept
    layer = RandomLayerTokenDrop(_Recorder())
    layer.init_config(sched, 0)
    x = torch.randn(BATCH, SEQ, WIDTH) if order == "batch_seq_dim" else torch.randn(SEQ, BATCH, WIDTH)
    x.requires_grad_(True)
    y = layer(x)
    inner = layer.random_ltd_layer
    changed = (y != x).any(dim=-1)  # (B, S) or (S, B)
    changed = changed if order == "batch_seq_dim" else changed.t()
    assert changed.sum(dim=1).tolist() == [6] * BATCH  # kept tokens changed, the rest are x itself
    # the kept tokens got exactly what the layer computes for them alone, in order
    first = changed[0].nonzero().squeeze(1)
    row = x[0, first] if order == "batch_seq_dim" else x[first, 0]
    got = y[0, first] if order == "batch_seq_dim" else y[first, 0]
    torch.testing.assert_close(got, row + inner.lin(row))
    # gradients: a dropped token's input gets exactly its output's gradient; the
    # weights only what the kept tokens give them
    weight = torch.randn_like(y)
    (y * weight).sum().backward()
    dropped = ~changed if order == "batch_seq_dim" else (~changed).t()
    assert torch.equal(x.grad[dropped], weight[dropped])
    assert not torch.equal(x.grad[~dropped], weight[~dropped])
    kept_in = x.detach()[~dropped]  # (B*6, C) in the same order as weight[~dropped]
    expected = weight[~dropped].t() @ kept_in
    torch.testing.assert_close(inner.lin.weight.grad, expected)


def test_masks_sliced_to_the_kept_tokens():
    positions = torch.tensor([[0, 2, 5], [1, 3, 4]])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    kept_causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    assert torch.equal(slice_mask(causal, positions, 6, "decoder"), kept_causal)
    full = torch.randn(2, 1, 6, 6)
    enc = slice_mask(full, positions, 6, "encoder")
    for b in range(2):
        assert torch.equal(enc[b, 0], full[b, 0][positions[b]][:, positions[b]])
    padding = torch.randn(2, 1, 1, 6)
    assert torch.equal(slice_mask(padding, positions, 6, "encoder")[:, 0, 0], padding[:, 0, 0].gather(1, positions))
    with pytest.raises(ValueError, match="needs the attention mask as"):
        slice_mask(torch.ones(2, 6, 6, 1, 1), positions, 6, "encoder")


def test_named_mask_is_sliced_and_must_be_passed():
    sched = _scheduler(model_mask_name="attention_mask")
    layer = RandomLayerTokenDrop(_Recorder())
    layer.init_config(sched, 0)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None]
    layer(torch.randn(BATCH, SEQ, WIDTH), attention_mask=mask)
    assert torch.equal(layer.random_ltd_layer.masks[0], mask[..., :4, :4])
    with pytest.raises(ValueError, match="without attention_mask="):
        layer(torch.randn(BATCH, SEQ, WIDTH))


# -- the plain model's state dict --------------------------------------------------------------

def test_saved_without_random_ltd_loads_as_the_plain_model():
    sched = _scheduler()
    model = _bound_stack(sched)
    assert any(".random_ltd_layer." in k for k in model.state_dict())
    plain = _Stack()
    plain.load_state_dict(save_without_random_ltd(model), strict=True)
    assert list(remove_random_ltd_state_dict(model.state_dict())) == list(plain.state_dict())
    x = torch.randn(BATCH, SEQ, WIDTH)
    model.eval()
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=0)


def test_convert_needs_a_layer_and_the_right_layer_count():
    with pytest.raises(ValueError, match="holds no Conv1d module"):
        convert_to_random_ltd(torch.nn.Sequential(_Recorder()), torch.nn.Conv1d)
    from dsrun.runtime.data_pipeline.data_routing.helper import bind_random_ltd_layers

    with pytest.raises(ValueError, match="total_layer_num is 4 but the model has 3"):
        bind_random_ltd_layers(convert_to_random_ltd(_Stack(3), _Recorder), _scheduler())


# -- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("over,match", [
    ({"random_ltd_layer_id": [1, 4]}, r"layer ids \[4\] are out of range.*numbered 0 to 3"),
    ({"random_ltd_layer_id": [1, 1]}, "lists a layer more than once"),
    ({"random_ltd_layer_num": 3}, "random_ltd_layer_num is 3 but random_ltd_layer_id lists 2"),
    ({"model_type": "vision"}, "model_type"),
    ({"hidden_state_order": "batch_first"}, "hidden_state_order"),
    ({"random_ltd_schedule": None}, "random_ltd_schedule is not set"),
    ({"random_ltd_schedule": {"min_value": 32, "max_value": 16,
                              "schedule_config": {"require_steps": 6, "seq_per_step": 2}}}, "min_value .32. is above"),
    ({"random_ltd_schedule": {"min_value": 4, "max_value": 16, "schedule_type": "fixed_root",
                              "schedule_config": {"require_steps": 6, "seq_per_step": 2}}}, "fixed_linear"),
    ({"layer_token_lr_schedule": {"enabled": True}}, "does not support a learning rate schedule in layer-tokens"),
])
def test_config_errors(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_config(_ltd(**over)))


def test_config_switches():
    assert random_ltd_scheduler(load_config({"train_batch_size": 4})) is None
    off = _config()
    off["data_efficiency"]["enabled"] = False
    with pytest.raises(ConfigError, match="random-LTD runs only with all three"):
        load_config(off)
    assert RandomLTDConfig(enabled=False).random_ltd_schedule is None  # a disabled section needs nothing


# -- the engine --------------------------------------------------------------------------------

def _engine_rank(steps: int, save_dir: str, convert_after: bool) -> dict:
    """One rank: a tiny byte GPT (examples/gpt_model.py), random-LTD on blocks 1 and 2,
    converted before initialize or (DeepSpeed's usage) on the engine after it."""
    sys.path.insert(0, str(EXAMPLES))
    import dsrun
    from gpt_model import GPT, Block, GPTConfig

    torch.manual_seed(0)
    seq = 32
    model = GPT(GPTConfig(seq_len=seq, n_layer=4, n_head=2, n_embd=32))
    if not convert_after:
        convert_to_random_ltd(model, Block)
    ltd = _ltd(random_ltd_schedule={"min_value": 8, "max_value": seq, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 20, "seq_per_step": 8}})
    cfg = _config(ltd, train_micro_batch_size_per_gpu=4, steps_per_print=10**6,
                  optimizer={"type": "AdamW", "params": {"lr": 3e-3}})
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    if convert_after:
        assert convert_to_random_ltd(engine, Block) is engine
    seen: list[list[int]] = []  # per step: tokens each block was given
    hooks = [b.random_ltd_layer.register_forward_pre_hook(lambda m, a: seen[-1].append(a[0].size(1)))
             for b in model.blocks]
    text = torch.arange(4 * seq + 1) * 7 % 256  # a repeating byte pattern the model can learn
    x = torch.stack([torch.roll(text, -k)[:seq] for k in range(4)])
    y = torch.stack([torch.roll(text, -k)[1:seq + 1] for k in range(4)])
    losses = []
    for _ in range(steps):
        seen.append([])
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    out = {"losses": losses, "seen": seen, "saved": engine.random_ltd_scheduler.state_dict()}
    engine.save_checkpoint(save_dir, tag="t")
    engine.random_ltd_scheduler.reset_to_init()
    engine.load_checkpoint(save_dir, tag="t")
    out["resumed"] = engine.random_ltd_scheduler.state_dict()
    plain = GPT(GPTConfig(seq_len=seq, n_layer=4, n_head=2, n_embd=32))
    plain.load_state_dict(save_without_random_ltd(engine), strict=True)
    plain.eval(), model.eval()
    out["plain_equal"] = torch.equal(plain(x), model(x))
    return out


@pytest.mark.parametrize("convert_after", [False, True], ids=["model-then-initialize", "engine-after-initialize"])
def test_engine_trains_with_random_ltd_and_resumes_the_schedule(tmp_path, convert_after):
    steps = 24
    out = run_ranks(_engine_rank, 1, steps, str(tmp_path), convert_after)[0]
    expected = [fixed_linear_value(s, 8, 32, 20, 8) for s in range(steps)]
    assert [row[1:3] for row in out["seen"]] == [[k, k] for k in expected]  # blocks 1 and 2 drop
    assert all(row[0] == row[3] == 32 for row in out["seen"])  # blocks 0 and 3 see every token
    assert sum(out["losses"][-4:]) < 0.6 * sum(out["losses"][:4])
    assert out["saved"]["current_value"] == 32 and out["saved"]["current_steps"] == steps
    assert out["resumed"] == out["saved"]
    assert out["plain_equal"]


def test_deepspeed_documented_example_loads_without_warnings():
    """The data_routing example of DeepSpeed's config-json page (GPT, 24 layers, Megatron layout)."""
    example = {"enabled": True, "seed": 1234, "data_routing": {"enabled": True, "random_ltd": _ltd(
        total_layer_num=24, random_ltd_layer_num=22, random_ltd_layer_id=list(range(1, 23)),
        model_mask_name="attention_mask", hidden_state_order="seq_batch_dim",
        random_ltd_schedule={"min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear",
                             "schedule_config": {"require_steps": 200000, "seq_per_step": 16}})}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"train_batch_size": 4, "data_efficiency": example})
    assert random_ltd_scheduler(cfg).get_value(100000) == 1088  # floor(0.5 * 1920 + 128), a multiple of 16

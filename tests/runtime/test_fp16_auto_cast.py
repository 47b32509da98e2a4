"""fp16.auto_cast: the engine casts the floating-point positional inputs of
forward to fp16 (DeepSpeed's engine._cast_inputs_half), nested in lists,
tuples and dicts; integer tensors, other objects and keyword arguments pass
as they are."""
from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

import dsrun
from dsrun.runtime.optim.precision import cast_floating

Pair = namedtuple("Pair", "a b")


class Recorder(torch.nn.Module):
    """Keeps what forward received; returns a loss of its weight."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.seen: tuple | None = None

    def forward(self, *inputs, **kwargs):
        self.seen = (inputs, kwargs)
        return (self.w * 2).sum()


def _inputs():
    x = torch.randn(3)
    ids = torch.arange(3)
    return (x, [x, (ids, Pair(x, "text"))], OrderedDict(mask=x, ids=ids, n=4)), {"labels": x}


def _engine(fp16: dict | None):
    model = Recorder()
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6}
    if fp16 is not None:
        config["fp16"] = fp16
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config=config)
    return engine, model


def test_auto_cast_casts_nested_floating_positional_inputs_to_fp16():
    engine, model = _engine({"enabled": True, "auto_cast": True})
    assert engine.fp16_auto_cast()
    inputs, kwargs = _inputs()
    loss = engine(*inputs, **kwargs)
    engine.backward(loss)
    engine.step()
    (x, nested, mapping), seen_kwargs = model.seen
    assert x.dtype == torch.float16 and torch.equal(x, inputs[0].half())
    assert isinstance(nested, list) and nested[0].dtype == torch.float16
    ids, pair = nested[1]
    assert ids.dtype == torch.int64 and torch.equal(ids, torch.arange(3))
    assert isinstance(pair, Pair) and pair.a.dtype == torch.float16 and pair.b == "text"
    assert isinstance(mapping, OrderedDict) and list(mapping) == ["mask", "ids", "n"]
    assert mapping["mask"].dtype == torch.float16 and mapping["ids"].dtype == torch.int64 and mapping["n"] == 4
    assert seen_kwargs["labels"].dtype == torch.float32  # keyword arguments are not cast, as in DeepSpeed
    assert inputs[2]["mask"].dtype == torch.float32  # the caller's containers are left alone
    engine.destroy()


@pytest.mark.parametrize("fp16", [None, {"enabled": True}, {"enabled": False, "auto_cast": True}])
def test_inputs_pass_unchanged_without_auto_cast_or_fp16(fp16):
    engine, model = _engine(fp16)
    assert not engine.fp16_auto_cast()
    inputs, _ = _inputs()
    engine(*inputs)
    assert model.seen[0][0] is inputs[0] and model.seen[0][2] is inputs[2]
    engine.destroy()


def test_cast_floating_other_dtypes_and_leaves():
    x = torch.randn(2, dtype=torch.float64)
    assert cast_floating(x, torch.bfloat16).dtype == torch.bfloat16
    assert cast_floating(None, torch.float16) is None
    flags = torch.tensor([True, False])
    assert cast_floating((flags,), torch.float16)[0] is flags

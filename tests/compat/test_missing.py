"""DeepSpeed names dsrun does not have stop with a message naming the feature."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import dsrun
import dsrun as deepspeed
from dsrun.compat.missing import MISSING_ATTRS, MISSING_MODULES, FeatureNotImplemented, FeatureNotImplementedError


@pytest.mark.parametrize("module", ["inference",
                                    "ops.transformer", "module_inject"])
def test_missing_module_import_names_the_feature(module):
    with pytest.raises(ImportError) as info:
        importlib.import_module(f"dsrun.{module}")
    assert isinstance(info.value, FeatureNotImplementedError)
    assert "is not implemented in dsrun" in str(info.value)
    feature = MISSING_MODULES[module.split(".")[0] if module.split(".")[0] in MISSING_MODULES
                              else ".".join(module.split(".")[:2])][0]
    assert feature in str(info.value)


def test_from_import_of_missing_module():
    with pytest.raises(ImportError, match="DeepSpeed-Inference"):
        from dsrun.inference import InferenceEngine  # noqa: F401


def test_moe_layer_marks_experts_and_param_groups_split():
    """CIFAR-10's example imports deepspeed.moe.utils unconditionally and builds
    deepspeed.moe.layer.MoE with --moe: its expert parameters go to a group of
    their own, named after the expert groups."""
    from dsrun.moe.layer import MoE
    from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer
    assert MoE is deepspeed.moe.layer.MoE and deepspeed.moe.experts.Experts
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), MoE(hidden_size=4, expert=torch.nn.Linear(4, 4),
                                                           num_experts=2))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "lr": 0.1})
    assert [len(g["params"]) for g in groups] == [3, 4] and groups[1]["moe"] and groups[1]["name"] == "ep_size_1"
    experts = set(map(id, model[1].deepspeed_moe.experts.parameters()))
    assert set(map(id, groups[1]["params"])) == experts and groups[0]["lr"] == groups[1]["lr"] == 0.1


@pytest.mark.parametrize("name", sorted(MISSING_ATTRS))
def test_missing_top_level_names(name):
    with pytest.raises(NotImplementedError, match=f"{name}: .* is not implemented in dsrun"):
        getattr(deepspeed, name)


def test_from_import_of_missing_name_keeps_the_message():
    with pytest.raises(FeatureNotImplemented, match="DeepSpeed-Inference"):
        from dsrun import init_inference  # noqa: F401


def test_unknown_names_are_still_attribute_errors():
    assert not hasattr(dsrun, "no_such_thing")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dsrun.no_such_module")


def test_engine_class_under_deepspeeds_path():
    from dsrun.runtime.engine import DeepSpeedEngine
    assert DeepSpeedEngine is deepspeed.DeepSpeedEngine is deepspeed.runtime.engine.Engine


def test_existing_modules_are_not_shadowed():
    # the finder is consulted last: real modules win
    assert importlib.import_module("dsrun.runtime.zero").Init is dsrun.zero.Init


def test_launcher_import_stays_light():
    # `import dsrun` (the launcher path) must not import torch for the finder
    code = "import sys, dsrun; import dsrun.launcher.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_pipeline_methods_raise():
    model = torch.nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for name in ("train_batch", "eval_batch", "set_dataiterator"):
        with pytest.raises(RuntimeError, match=rf"engine\.{name}\(\) belongs to the pipeline engine.*PipelineModule"):
            getattr(engine, name)()

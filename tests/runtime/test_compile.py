"""engine.compile(): torch.compile at ZeRO stages 0-3 against the same run in eager mode.

Every case trains TinyGPT (tied embedding/head, two blocks in a ModuleList:
three stage-3 units) for 2 steps eagerly and then compiled, from the same
seed, on 2 real gloo ranks. One spawn per backend runs its stages (a
spawn costs seconds; compiling costs more).

Tolerances: the "eager" backend (dynamo only) and "aot_eager" (plus
AOTAutograd's traced forward and backward) run the same aten kernels in the
same order as eager mode, so losses and parameters must be bit-identical.
Inductor generates its own fused kernels (layer norm, gelu, the
cross-entropy reductions) whose fp32 sums associate differently: the first
loss is identical, later ones differ in the last bits (1.5e-7 relative
measured at step 2); 1e-5 relative on losses and 1e-5 absolute on the
parameters (O(1) values after two AdamW steps of lr 1e-2, each moving a
weight by at most ~1e-2) leave a margin of ~50x without hiding a wrong
gradient, which moves losses by 1e-3 or more.
"""
import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.zero.models import base_config, train


def _compile_after_initialize(backend):
    """Make `train()`'s dsrun.initialize return an engine compiled with `backend`;
    returns the flags is_compiled had before and after."""
    import dsrun

    seen = []
    real = dsrun.initialize

    def initialize(*args, **kwargs):
        engine, *rest = real(*args, **kwargs)
        seen.append(engine.is_compiled)
        engine.compile(backend=backend)
        seen.append(engine.is_compiled)
        return (engine, *rest)

    dsrun.initialize = initialize
    return seen, lambda: setattr(dsrun, "initialize", real)


def _stages(backend, stages):
    """Per stage: (eager losses, compiled losses, max |param difference|,
    is_compiled before/after, graph breaks, state_dict keys equal, graphs dynamo captured)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dsrun.runtime.engine.compile import graph_breaks

    out = {}
    for stage in stages:
        cfg = base_config(stage, stage3_param_persistence_threshold=0)
        eager_losses, eager_full, eager_engine = train(cfg, steps=2)
        torch._dynamo.reset()  # also clears the graph-break counters
        flags, restore = _compile_after_initialize(backend)
        try:
            losses, full, engine = train(cfg, steps=2)
        finally:
            restore()
        diff = max((eager_full[n] - full[n]).abs().max().item() for n in eager_full)
        same_keys = list(engine.module.state_dict()) == list(eager_engine.module.state_dict())
        out[stage] = (eager_losses, losses, diff, flags, graph_breaks(), same_keys,
                      counters["stats"]["unique_graphs"])
    return out


def _check(results, exact):
    for stage, (eager, compiled, diff, flags, breaks, same_keys, graphs) in results.items():
        assert flags == [False, True], stage
        assert same_keys, stage
        assert graphs >= 1, stage  # something was compiled (stage 3: the blocks' forward at least)
        if exact:
            assert compiled == eager, stage
            assert diff == 0.0, stage
        else:
            assert compiled == pytest.approx(eager, rel=1e-5), stage
            assert diff < 1e-5, stage
        if stage < 3:  # parameter hooks only: the model is one graph
            assert breaks == {}, (stage, breaks)
        else:  # the root's forward calls the units, whose hooks run eagerly
            assert breaks and all("torch.compiler.disable" in reason for reason in breaks), breaks
            assert any("_register_hooks" in reason for reason in breaks), breaks


def test_eager_backend_equals_eager_mode_at_stages_0_and_3():
    """The quick case: the all-reduce strategy and the hooked stage 3 (stages
    1 and 2 run in the aot_eager test)."""
    rank0, rank1 = run_ranks(_stages, 2, "eager", (0, 3), timeout=600)
    assert rank0 == rank1
    _check(rank0, exact=True)


@pytest.mark.slow
def test_aot_eager_backend_equals_eager_mode_at_every_stage():
    rank0, _ = run_ranks(_stages, 2, "aot_eager", (0, 1, 2, 3), timeout=900)
    _check(rank0, exact=True)


@pytest.mark.slow
def test_inductor_matches_eager_mode_at_stages_0_and_3():
    rank0, _ = run_ranks(_stages, 2, "inductor", (0, 3), timeout=1200)
    _check(rank0, exact=False)


def _argument_errors():
    """The message of each bad engine.compile() call (type: text), and is_compiled after them."""
    import dsrun

    def engine_at(stage):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=base_config(stage, stage3_param_persistence_threshold=0))
        return engine

    out = {}
    engine = engine_at(0)
    for name, call in {
        "typo": lambda: engine.compile(backend="inductr"),
        "unknown": lambda: engine.compile(backend="tensorrt_fast"),
        "kwarg": lambda: engine.compile(backend="eager", compile_kwargs={"full_graph": True}),
        "kwargs type": lambda: engine.compile(backend="eager", compile_kwargs=["fullgraph"]),
        "backend type": lambda: engine.compile(backend=3),
        "compiled autograd": lambda: engine.compile(backend="eager", compiled_autograd_enabled=True),
        "fullgraph at stage 3": lambda: engine_at(3).compile(backend="eager", compile_kwargs={"fullgraph": True}),
    }.items():
        try:
            call()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            out[name] = f"{type(exc).__name__}: {exc}"
    out["compiled after errors"] = engine.is_compiled
    engine.compile(backend="eager", compile_kwargs={"fullgraph": True, "backend": "inductor"})
    out["fullgraph at stage 0"] = engine.is_compiled
    first = engine.module._compiled_call_impl
    engine.compile(backend="eager", compile_kwargs={"fullgraph": True})
    out["same settings kept"] = engine.module._compiled_call_impl is first
    engine.compile(backend="aot_eager")
    out["other settings recompiled"] = engine.module._compiled_call_impl is not first
    return out


def test_bad_arguments_raise_before_anything_is_compiled():
    (out,) = run_ranks(_argument_errors, 1, timeout=300)
    assert out["typo"].startswith("ValueError: engine.compile(): unknown torch.compile backend 'inductr'; "
                                  "did you mean 'inductor'?")
    assert "known here:" in out["unknown"] and "aot_eager" in out["unknown"]
    assert out["kwarg"].startswith("ValueError") and "['full_graph']" in out["kwarg"] and "fullgraph" in out["kwarg"]
    assert out["kwargs type"].startswith("TypeError") and "got list" in out["kwargs type"]
    assert out["backend type"].startswith("TypeError") and "got int" in out["backend type"]
    assert out["compiled autograd"].startswith("NotImplementedError")
    assert out["fullgraph at stage 3"].startswith("ValueError") and "stage 3" in out["fullgraph at stage 3"]
    assert out["compiled after errors"] is False
    assert out["fullgraph at stage 0"] is True  # compile_kwargs' backend dropped (warning), the argument's used
    assert out["same settings kept"] and out["other settings recompiled"]


def test_compile_section_is_validated():
    from dsrun.runtime.config import ConfigError, load_config

    def problem(section):
        with pytest.raises(ConfigError) as err:
            load_config({"train_micro_batch_size_per_gpu": 1, "compile": section}, world_size=1)
        return str(err.value)

    assert "compile.deepcompile=true" in problem({"deepcompile": True})
    assert "engine.compile()" in problem({"deepcompile": True})
    assert "compile.autoep_non_moe=true" in problem({"autoep_non_moe": True})
    assert "did you mean 'deepcompile'" in problem({"deep_compile": False})
    assert "compile.passes[0]: expected one of 'z1', 'z3', 'autosp', 'autotp', got 'z2'" in problem({"passes": ["z2"]})
    assert "expected true or false" in problem({"free_activation": "yes"})
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "compile": {"deepcompile": False, "passes": ["z3"], "free_activation": True}}, world_size=1)
    assert cfg.compile.passes == ["z3"] and cfg["compile"]["free_activation"] is True

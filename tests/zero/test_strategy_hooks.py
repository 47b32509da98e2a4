"""The strategies' hooks: labelled in profiles, all removed by engine.destroy().

See [Note: strategy hooks] in dsrun/runtime/strategy/hooks.py. One rank (a spawned
process) trains TinyGPT one step under `torch.profiler.profile` at stage 0
(the all-reduce strategy), 2 and 3, then destroys the engine; the tests
check the profile's dsrun labels, that the module and its parameters are
left with exactly the hooks they had before `initialize`, that the
watchdog thread stopped, and that the plain module still runs.
"""
from __future__ import annotations

import threading

import pytest
import torch

from dsrun.runtime.strategy.hooks import HookSet, labelled
from tests.dist_helpers import run_ranks
from tests.zero.models import TinyGPT, base_config, batches

CASES = {"stage0": (0, "fp32"), "stage2": (2, "bf16"), "stage3": (3, "fp32")}


def _hook_count(model: torch.nn.Module) -> int:
    """Forward (pre-)hooks of every module plus post-accumulate-grad hooks of every parameter."""
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    params = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return modules + params


def _watchdog_threads() -> int:
    return sum(t.name == "dsrun-zero-watchdog" and t.is_alive() for t in threading.enumerate())


def _one_case(stage: int, precision: str) -> dict:
    import dsrun
    from dsrun.runtime.zero import GatheredParameters

    torch.manual_seed(0)
    model = TinyGPT()
    model.register_forward_pre_hook(lambda m, a: None)  # the user's own hook stays
    before = _hook_count(model)
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  config=base_config(stage, precision, stage3_param_persistence_threshold=0))
    registered = _hook_count(model) - before
    (idx, tgt), (idx2, tgt2) = batches(0, 2, 2, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.backward(engine(idx, tgt))
        engine.step()
    labels = sorted({e.name for e in prof.events() if e.name.startswith("dsrun::")})
    with torch.no_grad():
        expected = engine(idx2, tgt2).float().item()  # the engine's forward with the trained weights
    watchdogs = _watchdog_threads()
    engine.destroy()
    engine.destroy()  # again: nothing
    out = {"registered": registered, "left": _hook_count(model) - before, "labels": labels,
           "watchdogs": (watchdogs, _watchdog_threads()), "expected": expected}
    if stage == 3:  # parameters stay partitioned: gathered by hand, no hook fetches them
        out["sizes"] = sorted({p.numel() for p in model.parameters()})
        with GatheredParameters(list(model.parameters())), torch.no_grad():
            out["plain"] = model(idx2, tgt2).float().item()
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss = model(idx2, tgt2)
            loss.backward()  # a plain backward: no reduction hook runs
        out["plain"] = loss.float().item()
        out["plain_labels"] = sorted({e.name for e in prof.events() if e.name.startswith("dsrun::")})
    return out


def _all_cases() -> dict:
    return {name: _one_case(*case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 1, timeout=300)[0]


def test_every_strategy_registers_hooks_and_destroy_removes_them_all(results):
    for name, r in results.items():
        assert r["registered"] > 0, name
        assert r["left"] == 0, name


def test_one_step_profile_shows_the_hook_labels(results):
    assert results["stage0"]["labels"] == ["dsrun::reduce_grad"]
    assert results["stage2"]["labels"] == ["dsrun::reduce_grad"]
    assert results["stage3"]["labels"] == ["dsrun::reduce_grad", "dsrun::stage3_post_forward",
                                           "dsrun::stage3_pre_backward", "dsrun::stage3_pre_forward",
                                           "dsrun::stage3_start_step"]


def test_the_plain_module_runs_after_destroy(results):
    for name in ("stage0", "stage2"):
        r = results[name]
        assert r["plain"] == pytest.approx(r["expected"], rel=1e-6), name
        assert r["plain_labels"] == [], name
    r = results["stage3"]
    assert r["sizes"] == [0]  # partitioned (as DeepSpeed's destroy leaves them)
    assert r["plain"] == pytest.approx(r["expected"], rel=1e-6)


def test_destroy_stops_the_stage3_watchdog(results):
    assert results["stage3"]["watchdogs"] == (1, 0)


def test_labelled_runs_the_function_and_names_only_dsrun_labels():
    calls = []
    fn = labelled("dsrun::test", lambda x: calls.append(x) or 2 * x)
    assert fn(3) == 6 and calls == [3]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert fn(4) == 8
    assert "dsrun::test" in {e.name for e in prof.events()}
    with pytest.raises(ValueError, match="dsrun::<what>"):
        labelled("reduce_grad", fn)


def test_hookset_removes_what_it_registered_only():
    layer = torch.nn.Linear(2, 2)
    own = layer.register_forward_hook(lambda m, a, o: None)
    hooks = HookSet()
    seen = []
    hooks.on_forward_pre(layer, "dsrun::a", lambda m, a: seen.append("pre"))
    hooks.on_forward(layer, "dsrun::b", lambda m, a, o: seen.append("post"))
    hooks.on_grad_accumulated(layer.weight, "dsrun::c", lambda p: seen.append("grad"))
    assert len(hooks) == 3
    layer(torch.ones(1, 2)).sum().backward()
    assert seen == ["pre", "post", "grad"]
    hooks.remove()
    hooks.remove()
    assert len(hooks) == 0 and len(layer._forward_hooks) == 1 and not layer._forward_pre_hooks
    assert not layer.weight._post_accumulate_grad_hooks
    own.remove()

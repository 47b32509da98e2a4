"""Measured memory per phase (dsrun.runtime.memory.profile) and the engine's wiring of it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import dsrun
from dsrun.runtime.memory import allocator
from dsrun.runtime import config as config_module
from dsrun.runtime.memory import profile as memory_profile
from dsrun.runtime.memory.profile import MemoryProfiler, format_memory_profile, no_phase
from tests.dist_helpers import run_ranks

ROOT = Path(__file__).resolve().parents[2]
MB = 100_000_000  # the "100 MB" temporaries below: 25M fp32 elements
PHASE_ORDER = ["construction", "initialize", "forward", "backward", "step"]


def _sane(record: dict) -> None:
    assert record["runs"] >= 1
    assert record["rss_start"] > 0 and record["rss_end"] > 0
    assert record["rss_peak"] >= record["rss_end"]
    assert record["rss_peak"] >= record["rss_start"]


# -- the profiler on its own (this process) -------------------------------------------------
def test_peak_covers_a_temporary_that_is_gone_at_the_end() -> None:
    prof = MemoryProfiler()
    allocator.trim()  # no cached block (resident already) may serve the temporary below
    with prof.phase("temporary"):
        x = torch.ones(MB // 4)  # ones() touches every page: +100 MB of RSS
        del x
        allocator.trim()  # the caching host allocator (if an earlier test installed it) keeps the block otherwise
    record = prof.profile()["phases"]["temporary"]
    _sane(record)
    assert record["rss_peak_reset"], memory_profile.rss_source()  # Linux with a writable /proc
    assert record["rss_peak"] - record["rss_start"] >= 0.95 * MB
    assert record["rss_end"] - record["rss_start"] < 0.5 * MB
    assert "new_tensors_peak" not in record and "largest" not in record  # not detailed
    json.dumps(prof.profile())


def test_nested_phase_does_not_erase_the_outer_peak() -> None:
    """The inner phase resets the kernel's peak; the outer one must keep the 100 MB it saw."""
    prof = MemoryProfiler()
    with prof.phase("outer"):
        x = torch.ones(MB // 4)
        del x
        allocator.trim()
        with prof.phase("inner"):
            pass
    phases = prof.profile()["phases"]
    assert phases["outer"]["rss_peak"] - phases["outer"]["rss_start"] >= 0.95 * MB
    assert phases["inner"]["rss_peak"] - phases["inner"]["rss_start"] < 0.5 * MB


def test_detailed_lists_the_allocation_and_ignores_views_and_in_place() -> None:
    prof = MemoryProfiler(detailed=True)
    x = torch.ones(5000, 5000)  # made before the phase: not counted
    with prof.phase("scale"):
        x.mul_(2.0)                      # in place: no new memory
        flat = x.view(-1)                # a view: no new memory
        y = flat.view(5000, 5000) * 3.0  # 100 MB, freed before the phase ends
        del y
    record = prof.profile()["phases"]["scale"]
    assert record["largest"][0] == {"op": "aten::mul", "shape": [5000, 5000], "dtype": "fp32",
                                    "device": "cpu", "bytes": MB}
    assert MB <= record["new_tensors_peak"]["cpu"] < MB + 2**20
    assert record["new_tensors_end"]["cpu"] == 0
    assert record["rss_peak"] - record["rss_start"] >= 0.95 * MB
    table = format_memory_profile(prof.profile())
    assert "largest in scale: aten::mul [5000x5000] fp32 cpu 95.4 MiB" in table


def test_repeats_merge_until_end_step() -> None:
    prof = MemoryProfiler(breakdown=lambda: {"params": {"fp32": 12}})
    for _ in range(2):
        with prof.phase("forward"):
            pass
    assert prof.profile()["phases"]["forward"]["runs"] == 2
    assert prof.profile()["phases"]["forward"]["tensors"] == {"params": {"fp32": 12}}
    prof.end_step(1)
    with prof.phase("forward"):
        pass
    profile = prof.profile()  # still the closed step 1 until step 2 ends
    assert profile["step"] == 1 and profile["phases"]["forward"]["runs"] == 2
    prof.end_step(2)
    assert prof.profile()["phases"]["forward"]["runs"] == 1


def test_format_memory_profile_table() -> None:
    mib = 2**20
    record = {"runs": 1, "rss_start": 100 * mib, "rss_end": 110 * mib, "rss_peak": 300 * mib,
              "rss_peak_reset": True, "cuda_allocated_start": 0, "cuda_allocated_end": 64 * mib,
              "cuda_allocated_peak": 832 * mib, "cuda_reserved_end": 1024 * mib,
              "cuda_reserved_peak": 1024 * mib,
              "tensors": {"params": {"bf16": 32 * mib}, "gathered_params": {"bf16": 0}},
              "new_tensors_peak": {"cuda": 768 * mib}, "new_tensors_end": {"cuda": 0},
              "largest": [{"op": "aten::mul", "shape": [201326592], "dtype": "fp32",
                           "device": "cuda", "bytes": 768 * mib}]}
    text = format_memory_profile({"rank": 1, "step": 7, "rss_source": "test",
                                  "phases": {"step": record}})
    lines = text.splitlines()
    assert lines[0] == "memory profile of rank 1 at step 7 (MiB; RSS via test)"
    assert lines[1].split() == ["phase", "runs", "rss", "rss_peak", "+peak", "cuda_alloc",
                                "cuda_peak", "cuda_reserved", "params", "gathered_params", "new_peak"]
    assert lines[2].split() == ["step", "1", "110.0", "300.0", "200.0", "64.0", "832.0", "1024.0",
                                "32.0", "0.0", "768.0"]
    assert lines[3] == "  largest in step: aten::mul [201326592] fp32 cuda 768.0 MiB"
    assert format_memory_profile({}) == "memory profile: no phases recorded"


def test_config_accepts_memory_breakdown() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ConfigWarning either: the key takes effect
        cfg = config_module.load_config({"train_micro_batch_size_per_gpu": 1,
                                         "memory_breakdown": True}, world_size=1)
    assert cfg.memory_breakdown is True
    assert "memory_breakdown" not in {e.path for e in config_module.NOT_YET_SUPPORTED}


# -- the engine, one process ------------------------------------------------------------------
def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Linear(width, 1))


def _train(engine, steps: int, batch: int) -> None:
    for _ in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(torch.randn(batch, 16)).square().mean()
        engine.backward(loss)
        engine.step()


def _single_process_main() -> dict:
    """Runs in a fresh interpreter with no rank variables: world size 1."""
    with memory_profile.phase("construction"):
        model = _model(2500)
    cfg = {"train_micro_batch_size_per_gpu": 1000, "gradient_accumulation_steps": 2,
           "steps_per_print": 2, "memory_breakdown": True,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    _train(engine, 2, 1000)
    out = {"plain": engine.memory_profile()}
    engine.enable_memory_profile(detailed=True, log=False)
    _train(engine, 1, 1000)
    out["detailed"] = engine.memory_profile()
    engine.disable_memory_profile()
    out["off_is_noop"] = engine._phase is no_phase
    _train(engine, 1, 1000)
    out["kept_step"] = engine.memory_profile()["step"]
    quiet, *_ = dsrun.initialize(model=_model(8), config=dict(cfg, memory_breakdown=False))
    _train(quiet, 1, 4)
    out["quiet"] = quiet.memory_profile()
    return out


def test_engine_profile_single_process() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    code = ("import json; from tests.runtime.test_memory_profile import _single_process_main;"
            "print(json.dumps(_single_process_main()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    plain = out["plain"]
    assert plain["rank"] == 0 and plain["step"] == 2 and not plain["detailed"]
    assert list(plain["phases"]) == PHASE_ORDER
    for record in plain["phases"].values():
        _sane(record)
    phases = plain["phases"]
    assert [phases[p]["runs"] for p in PHASE_ORDER] == [1, 1, 2, 2, 1]
    param_bytes = 4 * (16 * 2500 + 2500 + 2500 + 1)
    # `tensors` is the strategy's memory_breakdown() at each phase's end.
    assert phases["forward"]["tensors"]["params"] == {"fp32": param_bytes}
    assert phases["backward"]["tensors"]["grads"]["fp32"] >= param_bytes
    assert phases["step"]["tensors"]["optimizer_states"]["fp32"] >= 2 * param_bytes  # Adam
    # "memory_breakdown": true prints the table on rank 0 every steps_per_print steps.
    assert "memory profile of rank 0 at step 2" in proc.stdout
    assert "forward " in proc.stdout and "optimizer_states" in proc.stdout
    # The caching host allocator is in use from `initialize` on (it installs it): its bytes are part of RSS.
    assert "host_cached_end" not in phases["construction"]
    for name in PHASE_ORDER[1:]:
        assert 0 <= phases[name]["host_cached_end"] <= phases[name]["rss_end"], phases[name]
    assert "host_cache" in proc.stdout

    detailed = out["detailed"]
    assert detailed["step"] == 3 and detailed["detailed"]
    forward = detailed["phases"]["forward"]
    assert forward["largest"][0]["op"] == "aten::addmm"
    assert forward["largest"][0]["shape"] == [1000, 2500]
    assert forward["largest"][0]["bytes"] == 4 * 1000 * 2500
    assert forward["new_tensors_peak"]["cpu"] >= 4 * 1000 * 2500
    assert detailed["phases"]["backward"]["new_tensors_peak"]["cpu"] >= 4 * 1000 * 2500

    assert out["off_is_noop"] and out["kept_step"] == 3
    assert out["quiet"] == {}


# -- the engine, two gloo ranks ----------------------------------------------------------------
def _rank_main() -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 64, "steps_per_print": 1000, "memory_breakdown": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    engine, *_ = dsrun.initialize(model=_model(256), config=cfg)
    _train(engine, 1, 64)
    engine.enable_memory_profile(detailed=True)  # the dispatch mode around gradient all-reduce
    _train(engine, 1, 64)
    return engine.memory_profile()


def test_engine_profile_two_ranks() -> None:
    profiles = run_ranks(_rank_main, 2, timeout=120)
    for rank, profile in enumerate(profiles):
        json.dumps(profile)
        assert profile["rank"] == rank and profile["step"] == 2 and profile["detailed"]
        assert {"initialize", "forward", "backward", "step"} <= set(profile["phases"])
        for record in profile["phases"].values():
            _sane(record)
        backward = profile["phases"]["backward"]
        assert backward["tensors"]["grads"]["fp32"] >= 4 * (16 * 256 + 256 + 256 + 1)
        assert backward["largest"] and backward["new_tensors_peak"]["cpu"] > 0

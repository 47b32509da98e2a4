"""`dsrun-ckpt import-deepspeed` on checkpoints written by the real DeepSpeed.

The slow tests install DeepSpeed 0.19.8 (CPU, no ops built) into a cache
directory and run tests/checkpoint/deepspeed/make_fixtures.py, which trains
TinyNet on 2 gloo ranks at ZeRO 0-3 in fp32 and bf16 (BF16_Optimizer's
"bf16_" files included), saves, and records DeepSpeed's own view: the
fp32 weights of its zero_to_fp32, the full Adam states, the losses of the
next steps. The imported checkpoint must hold exactly those weights and
states, and dsrun resumed from it must continue with DeepSpeed's losses.
The fixtures are kept beside the DeepSpeed install, keyed on everything that
makes them (see `_fixture_key`), so a later run reuses them only where a new
run of make_fixtures.py would write the same files.
"""
import fcntl
import hashlib
import json
import os
import pickle
import platform
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from dsrun.runtime.checkpoint import CheckpointError
from dsrun.runtime.checkpoint.cli import main as ckpt_cli
from dsrun.runtime.checkpoint.deepspeed_import import import_deepspeed, read_pickle
from dsrun.runtime.checkpoint.store import resolve_tag
from tests.checkpoint.test_checkpoint import _full_state
from tests.dist_helpers import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
DEEPSPEED = "deepspeed==0.19.8"
DS_DEPS = ["hjson", "py-cpuinfo", "msgpack", "tqdm", "einops", "nvidia-ml-py"]
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dsrun-tests",
                     DEEPSPEED.replace("==", "-"))


def _install_deepspeed() -> str:
    """DeepSpeed and its pure-Python dependencies in CACHE (pip --target, no ops
    built); installed once, under a lock. Fails with pip's output."""
    os.makedirs(os.path.dirname(CACHE), exist_ok=True)
    with open(CACHE + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(CACHE, ".complete")):
            tmp = CACHE + ".tmp"
            subprocess.run(["rm", "-rf", tmp], check=True)
            done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", tmp, "--no-deps",
                                   DEEPSPEED, *DS_DEPS], env={**os.environ, "DS_BUILD_OPS": "0"},
                                  capture_output=True, text=True)
            if done.returncode:
                pytest.fail(f"pip could not install {DEEPSPEED}:\n{done.stdout}\n{done.stderr}")
            open(os.path.join(tmp, ".complete"), "w").close()
            subprocess.run(["rm", "-rf", CACHE], check=True)
            os.rename(tmp, CACHE)
    return CACHE


def _fixture_key(ds_path: str) -> str:
    """A digest of what the fixtures depend on: the generating code (every file
    of tests/checkpoint/deepspeed), the installed DeepSpeed and its
    dependencies (their dist-info names carry the versions), torch's version and
    the CPU kernels it dispatches to (bf16 rounding), Python and the machine."""
    h = hashlib.sha256()
    gen = os.path.join(HERE, "deepspeed")
    for name in sorted(n for n in os.listdir(gen) if n.endswith(".py")):
        with open(os.path.join(gen, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    dists = sorted(n for n in os.listdir(ds_path) if n.endswith(".dist-info"))
    h.update(repr((dists, torch.__version__, torch.backends.cpu.get_cpu_capability(), sys.version,
                   platform.machine())).encode())
    return h.hexdigest()[:24]


@pytest.fixture(scope="module")
def fixtures():
    """{case: DeepSpeed save directory} made by the real DeepSpeed (read only:
    the directories are shared between runs with the same `_fixture_key`)."""
    path = _install_deepspeed()
    root = CACHE + "-fixtures"
    out = os.path.join(root, _fixture_key(path))
    os.makedirs(root, exist_ok=True)
    with open(root + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(out, ".complete")):
            shutil.rmtree(root, ignore_errors=True)  # fixtures of other keys are stale
            tmp = out + ".tmp"
            os.makedirs(tmp)
            env = {**os.environ, "PYTHONPATH": path, "DS_ACCELERATOR": "cpu"}
            done = subprocess.run([sys.executable, os.path.join(HERE, "deepspeed", "make_fixtures.py"), tmp],
                                  env=env, capture_output=True, text=True, timeout=600)
            if done.returncode:
                pytest.fail(f"DeepSpeed could not make the fixtures:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
            open(os.path.join(tmp, ".complete"), "w").close()
            os.rename(tmp, out)
    return {case: os.path.join(out, case) for case in sorted(os.listdir(out)) if case != ".complete"}


def _expected(ds_dir):
    with open(os.path.join(ds_dir, "expected.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_import_matches_deepspeed(fixtures, tmp_path):
    """Every imported weight and Adam state equals DeepSpeed's, bit for bit."""
    assert len(fixtures) == 8
    files = {f for d in fixtures.values() for f in os.listdir(os.path.join(d, "global_step3"))}
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in files  # BF16_Optimizer's layout is covered
    for case, ds_dir in fixtures.items():
        out = str(tmp_path / case)
        if case == "stage3_bf16":  # through the command line once
            result = CliRunner().invoke(ckpt_cli, ["import-deepspeed", ds_dir, out])
            assert result.exit_code == 0, result.output
        else:
            import_deepspeed(ds_dir, out)
        exp = _expected(ds_dir)
        from safetensors.torch import load_file
        got = load_file(os.path.join(out, "global_step3", "rank00000-of-00001.safetensors"))
        for name, states in exp["engine"].items():
            assert torch.equal(got[f"module/{name}"], torch.tensor(states["fp32"])), (case, name)
            if exp["zero_to_fp32"] is not None:  # DeepSpeed's own zero_to_fp32 agrees
                assert torch.equal(got[f"module/{name}"], torch.tensor(exp["zero_to_fp32"][name])), (case, name)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[f"optim/{name}/{key}"], torch.tensor(states[key])), (case, name, key)
        assert torch.equal(got["module/scale"], torch.tensor([0.5, 2.0]))  # the buffer
        result = CliRunner().invoke(ckpt_cli, ["verify", out])
        assert result.exit_code == 0, result.output


def _resume_rank(imported: dict, expected: dict, world: int):
    """Load each imported checkpoint into dsrun at its own stage and
    precision; return (state equal to DeepSpeed's, losses of the next steps)."""
    import dsrun
    from dsrun.runtime import comm

    sys.path.insert(0, os.path.join(HERE, "deepspeed"))
    from model import TinyNet, batch

    rank = int(os.environ.get("RANK", "0"))
    out = {}
    for case, path in imported.items():
        exp = expected[case]
        torch.manual_seed(7)  # not DeepSpeed's initial weights: the load must replace them
        model = TinyNet()
        cfg = {"train_micro_batch_size_per_gpu": 2 * 2 // world, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": exp["stage"] if world == 2 else 0}, "steps_per_print": 10**6}
        if exp["precision"] == "bf16":
            cfg["bf16"] = {"enabled": True}
        opt = torch.optim.AdamW(model.parameters(), lr=exp["lr"], weight_decay=0.01)
        engine, *_ = dsrun.initialize(model=model, optimizer=opt, config=cfg)
        engine.load_checkpoint(path)
        params, states = _full_state(engine)
        same = all(torch.equal(params[n], torch.tensor(s["fp32"]).view(params[n].shape))
                   and all(torch.equal(states[f"{n}/{k}"].reshape(-1), torch.tensor(s[k]))
                           for k in ("exp_avg", "exp_avg_sq"))
                   for n, s in exp["engine"].items())
        losses = []
        for i in range(len(exp["losses_after"])):
            step = exp["steps_before"] + i
            parts = [batch(step, r) for r in ([rank] if world == 2 else [0, 1])]  # 1 rank: both micro-batches
            idx, tgt = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            t = loss.detach().float().clone()
            comm.all_reduce(t)
            losses.append(t.item() / world)
        out[case] = {"same": same, "losses": losses, "global_steps": engine.global_steps}
    return out


@pytest.mark.slow
def test_resume_continues_like_deepspeed(fixtures, tmp_path):
    """dsrun resumes each DeepSpeed run on 2 ranks at its stage, and the fp32
    ones on 1 process at stage 0, with DeepSpeed's weights, Adam states and
    next losses (fp32: to 1e-6; bf16: to 2e-2, 16-bit compute differs)."""
    imported = {case: import_deepspeed(d, str(tmp_path / case)) for case, d in fixtures.items()}
    imported = {case: os.path.dirname(path) for case, path in imported.items()}
    expected = {case: _expected(d) for case, d in fixtures.items()}
    two = run_ranks(_resume_rank, 2, imported, expected, 2, timeout=300)[0]
    fp32 = {c: p for c, p in imported.items() if c.endswith("fp32")}
    one = run_ranks(_resume_rank, 1, fp32, expected, 1, timeout=300)[0]
    for results in (two, one):
        for case, got in results.items():
            exp = expected[case]
            assert got["same"], case
            assert got["global_steps"] == exp["steps_before"] + len(exp["losses_after"])
            tol = 1e-6 if exp["precision"] == "fp32" else 2e-2
            assert got["losses"] == pytest.approx(exp["losses_after"], rel=tol, abs=tol), case


class _Payload:
    """Unpickling this would run a command: the importer must refuse it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_refuses_other_classes(tmp_path):
    marker = tmp_path / "ran"
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    torch.save({"module": {"w": torch.zeros(2)}, "evil": _Payload(marker)}, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt holds the class posix.system|"
                                              r"mp_rank_00_model_states.pt holds the class os.system"):
        import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "out"))
    assert not marker.exists()
    # A plain pickle (not a torch.save zip) is refused too, and never loaded freely.
    with open(tag / "mp_rank_00_model_states.pt", "wb") as f:
        pickle.dump({"x": _Payload(marker)}, f)
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt"):
        read_pickle(str(tag / "mp_rank_00_model_states.pt"))
    assert not marker.exists()
    # load_checkpoint on a DeepSpeed directory says how to convert it.
    with pytest.raises(CheckpointError, match="import-deepspeed"):
        resolve_tag(str(tmp_path / "ds"), None)
    assert not (tmp_path / "out" / "latest").exists()

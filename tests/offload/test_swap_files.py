"""NVMe swap files: refused up front with a clear error, errors naming the file
when one goes bad mid-run, and nothing left behind (normal exit, exception,
a SIGKILLed rank under the dsrun launcher)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsrun.runtime.offload import swap
from tests.dist_helpers import run_ranks
from tests.zero.models import base_config, train

SCRIPTS = Path(__file__).parent / "scripts"


def _nvme_config(path, stage=2, prec="fp32"):
    return base_config(stage, prec, sub_group_size=200,
                       offload_optimizer={"device": "nvme", "nvme_path": str(path)})


def _error(fn, *args):
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _nvme_engine(path, model=None, stage=2):
    import dsrun
    from tests.zero.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT() if model is None else model
    config = {**_nvme_config(path, stage), "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    return dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def _break_swap_file(engine, how):
    """Step once, break this rank's exp_avg swap file, step again: the error."""
    from tests.zero.models import batches

    data = batches(engine.global_rank, 2, 2, 1)
    engine.backward(engine(*data[0]))
    engine.step()
    file = engine.strategy.optimizer_tier.swap.files["exp_avg"]
    if how == "deleted":
        file.unlink()
    else:
        os.truncate(file, 100)
    engine.backward(engine(*data[1]))
    return str(file), _error(engine.step)


def _two_rank_cases(tmp):
    """Run on 2 ranks: a missing nvme_path, then a deleted and a truncated swap file."""
    out = {"missing": _error(_nvme_engine, os.path.join(tmp, "nope"))}
    for how in ("deleted", "truncated"):
        out[how] = _break_swap_file(_nvme_engine(tmp), how)
    return out


@pytest.fixture(scope="module")
def two_rank_cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swap")
    return run_ranks(_two_rank_cases, 2, str(tmp), timeout=180), tmp


def test_missing_path_is_refused_before_training(two_rank_cases):
    results, tmp = two_rank_cases
    for out in results:
        e = out["missing"]
        assert "offload_optimizer.nvme_path" in e and str(tmp / "nope") in e and "does not exist" in e


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_broken_swap_file_names_the_file_and_nothing_is_left(two_rank_cases, how):
    results, tmp = two_rank_cases
    for out in results:
        file, error = out[how]
        assert error is not None and error.startswith("SwapError") and file in error and how in error
    assert os.listdir(tmp) == []  # removed at exit although training failed


def test_too_little_space_is_refused_with_sizes(tmp_path, monkeypatch):
    class Small:  # what statvfs says about a filesystem with 1 MiB free
        f_bavail, f_frsize = 256, 4096
    monkeypatch.setattr(swap.os, "statvfs", lambda p: Small)
    with pytest.raises(swap.SwapError, match=r"needs 0\.01 GiB .* has 0\.00 GiB available"):
        swap.SwapDir.create(tmp_path, 0, {"exp_avg": 8 << 20}, "offload_optimizer.nvme_path", "optimizer")
    assert os.listdir(tmp_path) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (needs root: CI runs as root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def _losses(path, device):
    cfg = base_config(2, "bf16", sub_group_size=200, offload_optimizer={"device": device, "nvme_path": path})
    return train(cfg, steps=2, optimizer="config")[0]


def _one_rank_cases(tmpfs, file):
    """Run on 1 rank: a file as nvme_path, a model too big for the tmpfs, and
    a filesystem without O_DIRECT (buffered I/O, same losses)."""
    out = {"file": _error(_nvme_engine, file),
           # 262k parameters: 1 MiB per moment file, more than the tmpfs has.
           "small": _error(_nvme_engine, tmpfs, torch.nn.Sequential(torch.nn.Linear(512, 512)))}
    swap.supports_o_direct = lambda path: False
    out["buffered"] = _losses(tmpfs, "nvme")
    out["none"] = _losses(tmpfs, "none")
    return out


def test_bad_paths_on_one_rank(small_tmpfs, tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    (out,) = run_ranks(_one_rank_cases, 1, str(small_tmpfs), str(file), timeout=180)
    assert "not a directory" in out["file"] and str(file) in out["file"]
    assert "GiB available" in out["small"] and str(small_tmpfs) in out["small"]
    assert out["buffered"] == out["none"]
    assert os.listdir(small_tmpfs) == []


def test_swap_directory_is_per_job_and_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("DSRUN_JOB_ID", "job/42")
    d = swap.SwapDir.create(tmp_path, 3, {"exp_avg": 4096}, "offload_optimizer.nvme_path", "optimizer")
    assert d.path == tmp_path.resolve() / "dsrun-job_42" / "rank3.optimizer"
    assert d.files["exp_avg"].stat().st_size == 4096  # preallocated
    d.remove()
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_sigkilled_rank_files_are_removed_by_the_agent(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    r = subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", "2", "--grace_period", "2",
                        str(SCRIPTS / "killed_rank.py"), str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
    assert r.returncode != 0
    swaps = [line.split("SWAP ", 1)[1] for line in r.stdout.splitlines() if "SWAP " in line]
    assert len(swaps) == 2, r.stdout + r.stderr
    assert [p for p in os.listdir(tmp_path) if p.startswith("dsrun-")] == []

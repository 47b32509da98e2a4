"""What a plain `pip install dsrun` gets: its install requirements only.

The test suite's own venv has the `[test]` extra, which brings NumPy; torch
works without NumPy but `tensor.numpy()` and the object collectives
(`all_gather_object`) then fail, so code that needs NumPy passes every other
test and breaks for users. Here a fresh venv gets torch (the version of the
suite's venv, from the same indexes the Makefile uses) and a non-editable
install of a clean copy of this tree, without extras; then, from that venv:

- `import torch` there warns "Failed to initialize NumPy" (torch's own import
  asks for NumPy), which no dsrun command may pass on to the user (see
  [Note: torch's NumPy warning] in dsrun/numpy_warning.py);
- fp16 training on 2 ranks through the installed `dsrun` launcher, with an
  inf injected into one gradient on the first step, at ZeRO stages 0, 2 and 3:
  the step is skipped, the loss scale halves, the warning names the parameter,
  and the next step is applied (tests/install/fp16_overflow.py), and no rank
  prints torch's NumPy warning;
- `dsrun-report`: exit 0, and no NumPy warning from torch; `dsrun-ckpt`: no
  NumPy warning either;
- the aio Python fallback (AioHandle's engine when liburing is missing);
- a checkpoint save and load on 2 ranks.

Takes about 40 s here (about 20 s of it the pip install).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NUMPY_WARNING = "Failed to initialize NumPy: No module named 'numpy'"

AIO_CHECK = """
import torch
from dsrun.ops.aio import AioHandle
h = AioHandle(engine="python")
t = torch.arange(1000, dtype=torch.float32)
h.async_pwrite(t, "x.bin"); h.wait()
u = torch.empty_like(t)
h.async_pread(u, "x.bin"); h.wait()
assert torch.equal(t, u)
print("aio ok")
"""


def _run(cmd, *, env, cwd, timeout):
    proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return proc, f"$ {' '.join(map(str, cmd))}\n(exit {proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain_install")
    src = tmp / "src"  # a clean copy, as from a fresh clone: the build must not touch the working tree
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             "runs", "logs", ".pytest_cache"))
    venv = tmp / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "250"
    proc, log = _run([sys.executable, "-m", "venv", venv], env=env, cwd=tmp, timeout=300)
    assert proc.returncode == 0, log
    py = venv / "bin" / "python"
    # The torch of the suite's venv (the Makefile's pin, from local disk here) and dsrun without extras, in
    # one resolve. --no-compile: pip byte-compiles every module of torch at install (about 8 s of CPU here),
    # while Python compiles the few hundred that a rank imports on first use and caches them in the venv.
    proc, log = _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                      f"torch=={torch.__version__}", src], env=env, cwd=tmp, timeout=900)
    assert proc.returncode == 0, log
    run_dir = tmp / "run"
    run_dir.mkdir()
    return venv, env, run_dir


@pytest.mark.slow
def test_plain_install_has_no_numpy_and_imports_the_installed_dsrun(plain_venv):
    venv, env, run_dir = plain_venv
    proc, log = _run([venv / "bin" / "python", "-c", "import numpy"], env=env, cwd=run_dir, timeout=120)
    assert proc.returncode != 0 and "No module named 'numpy'" in proc.stderr, log
    proc, log = _run([venv / "bin" / "python", "-c", "import dsrun; print(dsrun.__file__)"],
                     env=env, cwd=run_dir, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().startswith(str(venv)), log
    # What dsrun's ranks must not show: torch's import alone warns here.
    proc, log = _run([venv / "bin" / "python", "-c", "import torch"], env=env, cwd=run_dir, timeout=120)
    assert proc.returncode == 0 and NUMPY_WARNING in proc.stderr, log


@pytest.mark.slow
def test_plain_install_fp16_overflow_skips_and_recovers_on_two_ranks(plain_venv):
    venv, env, run_dir = plain_venv
    shutil.copy(HERE / "fp16_overflow.py", run_dir / "fp16_overflow.py")
    proc, log = _run([venv / "bin" / "dsrun", "--num_procs", "2", "fp16_overflow.py"],
                     env=env, cwd=run_dir, timeout=300)
    assert proc.returncode == 0, log
    out = proc.stdout + proc.stderr
    assert "Numpy is not available" not in out and NUMPY_WARNING not in out, log
    for stage in (0, 2, 3):
        assert (f"RESULT stage={stage} skipped=1 scale=1024->512 named=1.weight second_applied=True" in out), log
    warning = "fp16 gradient overflow (first in parameter 1.weight); skipping step, loss scale 1024 -> 512"
    assert out.count(warning) == 3, log  # once per stage, from rank 0 only


@pytest.mark.slow
def test_plain_install_dsrun_report_prints_no_numpy_warning(plain_venv):
    venv, env, run_dir = plain_venv
    proc, log = _run([venv / "bin" / "dsrun-report"], env=env, cwd=run_dir, timeout=600)
    assert proc.returncode == 0, log
    assert "dsrun native ops" in proc.stdout and "torch " in proc.stdout, log
    assert "numpy" not in (proc.stdout + proc.stderr).lower(), log


@pytest.mark.slow
def test_plain_install_dsrun_ckpt_prints_no_numpy_warning(plain_venv, tmp_path):
    venv, env, run_dir = plain_venv
    proc, log = _run([venv / "bin" / "dsrun-ckpt", "inspect", tmp_path], env=env, cwd=run_dir, timeout=300)
    assert "numpy" not in (proc.stdout + proc.stderr).lower(), log
    assert str(tmp_path) in proc.stdout + proc.stderr, log  # it ran and looked into the directory


@pytest.mark.slow
def test_plain_install_aio_python_fallback(plain_venv):
    venv, env, run_dir = plain_venv
    proc, log = _run([venv / "bin" / "python", "-c", AIO_CHECK], env=env, cwd=run_dir, timeout=120)
    assert proc.returncode == 0 and "aio ok" in proc.stdout, log


@pytest.mark.slow
def test_plain_install_checkpoint_save_and_load(plain_venv):
    venv, env, run_dir = plain_venv
    shutil.copy(HERE / "checkpoint_roundtrip.py", run_dir / "checkpoint_roundtrip.py")
    proc, log = _run([venv / "bin" / "dsrun", "--num_procs", "2", "checkpoint_roundtrip.py", run_dir / "ckpt"],
                     env=env, cwd=run_dir, timeout=300)
    assert proc.returncode == 0 and "CHECKPOINT OK" in proc.stdout + proc.stderr, log

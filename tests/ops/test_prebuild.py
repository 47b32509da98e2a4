"""Ahead-of-time build: `DSRUN_BUILD_OPS=1 pip install --no-build-isolation .`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_carries_prebuilt_ops_that_load_without_a_compiler(tmp_path):
    src = tmp_path / "src"  # a clean copy, as from a fresh clone, so the build cannot touch the working tree
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             "runs", "logs", ".pytest_cache"))
    env = {**os.environ, "DSRUN_BUILD_OPS": "1", "DSRUN_OPS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("dsrun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for op in ("cpu_adam", "quantizer", "aio", "shm_comm", "host_alloc"):
        assert any(n.startswith(f"dsrun/ops/_prebuilt/{op}-") and n.endswith(f"dsrun_{op}.so") for n in names), op
    assert "dsrun/ops/csrc/cpu_adam/adam_impl.h" in names
    assert not any(n.endswith(".o") for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    # No compiler and an empty cache: only the prebuilt libraries can load.
    out = subprocess.run([sys.executable, "-c", "from dsrun.ops import adam, aio, quantizer, shm_comm, builder; "
                          "assert adam.native_available() and shm_comm.available(), 'fallback'; "
                          "assert quantizer.native_available(), 'quantizer fallback'; "
                          "assert builder.get_op('host_alloc').load() is not None, 'no host_alloc'; "
                          "assert aio.AioHandle().engine != 'python'; "
                          "assert str(builder.get_op('aio').path).startswith(%r)" % str(site)],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site), "CXX": "/nonexistent/c++",
                                            "DSRUN_OPS_CACHE": str(tmp_path / "empty")},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]

"""`dsrun-report` output."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report(*args: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-m", "dsrun.ops.report", *args], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "250", **env}, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _row(text: str, op: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"│ {op} "))
    return [c.strip() for c in line.strip("│").split("│")]


def test_report_lists_every_op_with_isa_and_versions():
    text = _report()
    adam = _row(text, "cpu_adam")
    assert adam[1:4] == ["yes", "yes", "yes"] and adam[4] in ("avx2", "avx512", "scalar")
    for op in ("aio", "shm_comm"):
        assert _row(text, op)[1:4] == ["yes", "yes", "yes"]
    assert _row(text, "aio")[4] in ("engine io_uring", "engine libaio")  # what the kernel allows here
    cuda = _row(text, "cuda_adam")
    if "CPU build" in cuda[5]:
        assert cuda[1:4] == ["no", "no", "no"]
    assert "torch " in text and "C++ compiler" in text and "nvcc:" in text


def test_report_without_compiler_says_why(tmp_path):
    text = _report("--no-build", CXX="/nonexistent/c++", DSRUN_OPS_CACHE=str(tmp_path))
    row = _row(text, "cpu_adam")
    assert row[1:4] == ["no", "no", "no"] and "C++ compiler '/nonexistent/c++' not found" in row[5]


def test_strict_passes_when_every_buildable_cpu_op_loads():
    out = subprocess.run([sys.executable, "-m", "dsrun.ops.report", "--strict"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "250"}, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fell back" not in out.stderr


def test_strict_fails_naming_a_cpu_op_that_falls_back():
    out = subprocess.run([sys.executable, "-m", "dsrun.ops.report", "--strict"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "250", "DSRUN_OPS_DISABLE": "aio,shm_comm"},
                         timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    listed = out.stderr.split("fell back to PyTorch:", 1)[1].split()
    assert "aio:" in listed and "shm_comm:" in listed and "cpu_adam:" not in listed, out.stderr
    assert "disabled by DSRUN_OPS_DISABLE" in out.stderr


def test_strict_does_not_count_ops_this_machine_cannot_build(tmp_path):
    # No compiler and an empty cache: nothing is buildable here, so nothing fell back.
    out = subprocess.run([sys.executable, "-m", "dsrun.ops.report", "--strict"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "COLUMNS": "250", "CXX": "/nonexistent/c++",
                                                      "DSRUN_OPS_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert _row(out.stdout, "aio")[1:4] == ["no", "no", "no"]

"""The op builder: cache reuse, one build under concurrency, and the fallbacks."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsrun.ops import builder

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


TINY_SPEC = "builder.OpSpec(name='tiny', sources=('tiny/tiny.cpp',), hashed_dirs=('tiny',))"


@pytest.fixture
def tiny_op(tmp_path, monkeypatch):
    """A one-file op in its own csrc/ and cache, cheap to build many times."""
    src = tmp_path / "csrc"
    (src / "tiny").mkdir(parents=True)
    (src / "tiny" / "tiny.cpp").write_text('extern "C" int dsrun_tiny(int x) { return 2 * x; }\n')
    monkeypatch.setattr(builder, "_CSRC_CANDIDATES", (src,))
    monkeypatch.setenv("DSRUN_OPS_CACHE", str(tmp_path / "cache"))
    env = {"DSRUN_OPS_CACHE": str(tmp_path / "cache")}
    prelude = f"from pathlib import Path; from dsrun.ops import builder; builder._CSRC_CANDIDATES = (Path({str(src)!r}),)\n"
    return eval(TINY_SPEC), env, prelude


def test_cache_is_reused(tiny_op):
    spec, env, prelude = tiny_op
    lib = builder.build(spec)
    assert lib.parent == Path(env["DSRUN_OPS_CACHE"]) / f"tiny-{builder.cache_key(spec)}"
    assert ctypes.CDLL(str(lib)).dsrun_tiny(21) == 42
    mtime = lib.stat().st_mtime_ns
    assert builder.build(spec) == lib and lib.stat().st_mtime_ns == mtime  # not rebuilt
    # A library with no completion marker (a killed build) is rebuilt by the
    # next process, not trusted; torch's stale lock file does not block it.
    (lib.parent / "BUILD_OK").unlink()
    # Unlink first: this process has the library mapped, and truncating a
    # mapped file in place makes the next touch of its pages (at exit) SIGBUS.
    lib.unlink()
    lib.write_bytes(b"half-written")
    (lib.parent / "lock").write_text("")
    out = _python(prelude + f"import ctypes; assert ctypes.CDLL(str(builder.build({TINY_SPEC}))).dsrun_tiny(2) == 4", env)
    assert out.returncode == 0, out.stderr
    assert lib.stat().st_size > 1000 and (lib.parent / "BUILD_OK").exists()
    # A changed source is a new key, hence a new directory.
    (Path(builder.csrc_dir()) / "tiny" / "tiny.cpp").write_text('extern "C" int dsrun_tiny(int x) { return 3 * x; }\n')
    assert builder.build(spec).parent != lib.parent


def test_concurrent_ranks_build_once(tiny_op):
    spec, env, prelude = tiny_op
    code = prelude + f"import ctypes; assert ctypes.CDLL(str(builder.build({TINY_SPEC}))).dsrun_tiny(1) == 2"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env},
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        assert p.wait(timeout=240) == 0, p.stderr.read()
    (build_dir,) = Path(env["DSRUN_OPS_CACHE"]).iterdir()
    # ninja logs every command it runs: one compile and one link, once.
    outputs = [ln.split("\t")[3] for ln in (build_dir / ".ninja_log").read_text().splitlines()
               if not ln.startswith("#")]
    assert sorted(outputs) == ["dsrun_tiny.so", "tiny.o"]


def test_missing_compiler_falls_back_with_one_line(tmp_path):
    out = _python("""
        import torch
        from dsrun.ops import adam
        p, g, m, v = torch.ones(10), torch.ones(10), torch.zeros(10), torch.zeros(10)
        for step in (1, 2):
            adam.adam_step(p, g, m, v, step=step, lr=0.1)
        assert not adam.native_available() and adam.selected_isa() is None
        print(p[0].item())
    """, {"CXX": "/nonexistent/g++", "DSRUN_OPS_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines == ["dsrun.ops: cpu_adam: using the PyTorch fallback: C++ compiler '/nonexistent/g++' not found "
                     "(install g++ or set CXX to a C++ compiler)"]
    assert float(out.stdout) == pytest.approx(0.8, abs=1e-6)  # two steps of lr 0.1 against a constant gradient


def test_disable_env_forces_fallback():
    out = _python("from dsrun.ops import adam; print(adam.native_available())", {"DSRUN_OPS_DISABLE": "cpu_adam"})
    assert out.stdout.strip() == "False" and "disabled by DSRUN_OPS_DISABLE" in out.stderr


def test_compile_error_and_missing_header_give_reasons(tmp_path, monkeypatch):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "broken.cpp").write_text("int f() { return undeclared_name; }\n")
    monkeypatch.setattr(builder, "_CSRC_CANDIDATES", (tmp_path,))
    monkeypatch.setenv("DSRUN_OPS_CACHE", str(tmp_path / "cache"))
    op = builder.NativeOp(builder.OpSpec(name="broken", sources=("broken/broken.cpp",)))
    assert op.load() is None
    assert op.reason.startswith("build failed:") and "undeclared_name" in op.reason and "build.log" in op.reason
    op = builder.NativeOp(builder.OpSpec(name="noheader", sources=("broken/broken.cpp",),
                                         headers=("linux/io_uring.h", "dsrun_no_such_header.h")))
    assert op.load() is None
    assert op.reason == "header <dsrun_no_such_header.h> not found (install its -dev package)"

"""The native-ops build cache loads only what this user built (issue 11, item 4).

The probe: a BUILD_OK marker planted in a shared DSRUN_OPS_CACHE named an
absolute path, and every rank dlopen'ed that foreign library. Here a
"foreign" library is a real shared object whose function answers 99
instead of the genuine op's 2x.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dsrun.ops import builder
from tests.ops.test_builder import TINY_SPEC, _python, tiny_op  # noqa: F401 (tiny_op: a one-file op, own cache)

pytestmark = pytest.mark.slow


@pytest.fixture
def foreign_library(tmp_path) -> Path:
    src = tmp_path / "evil.c"
    src.write_text("int dsrun_tiny(int x) { return 99; }\n")
    lib = tmp_path / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _build(tiny, umask: int | None = None) -> Path:
    """Build the op in a fresh process (torch's JIT builds a name once per process; keep this one clean)."""
    _, env, prelude = tiny
    code = (f"import os; os.umask({umask})\n" if umask is not None else "") + prelude
    out = _python(code + f"print(builder.build({TINY_SPEC}))", env)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def _load(tiny) -> str:
    """Load the op as a new rank would (a fresh process: torch builds a name once per process); its answer to 21."""
    _, env, prelude = tiny
    out = _python(prelude + f"lib = builder.NativeOp({TINY_SPEC}).load(); print(lib.dsrun_tiny(21) if lib else None)",
                  env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_planted_marker_with_a_path_is_never_followed(tiny_op, foreign_library):
    spec, env, _ = tiny_op
    genuine = _build(tiny_op)
    marker = genuine.parent / "BUILD_OK"
    for planted in (str(foreign_library), "../../" + foreign_library.name, json.dumps(
            {"library": str(foreign_library), "sha256": builder._sha256(foreign_library)})):
        marker.write_text(planted)
        assert builder.built_library(spec) is None  # not a complete build: never the foreign path
        assert _load(tiny_op) == "42"  # rebuilt and loaded the genuine op
        assert json.loads(marker.read_text())["library"] == genuine.name


def test_a_replaced_library_fails_its_sha256_and_is_rebuilt(tiny_op, foreign_library):
    spec, env, _ = tiny_op
    genuine = _build(tiny_op)
    genuine.unlink()
    genuine.write_bytes(foreign_library.read_bytes())
    assert builder.built_library(spec) is None
    assert _load(tiny_op) == "42"


def test_a_cache_others_can_write_is_refused(tiny_op, tmp_path):
    spec, env, _ = tiny_op
    root = Path(env["DSRUN_OPS_CACHE"])
    root.mkdir()
    root.chmod(0o777)  # a "shared" cache
    op = builder.NativeOp(spec)
    assert op.load() is None
    assert "is writable by group or others (mode 777)" in op.reason and "DSRUN_OPS_CACHE" in op.reason
    root.chmod(0o700)
    assert _load(tiny_op) == "42"


def test_cache_directories_are_created_private(tiny_op, tmp_path):
    spec, env, prelude = tiny_op
    fresh = (spec, {"DSRUN_OPS_CACHE": str(tmp_path / "fresh" / "cache")}, prelude)
    lib = _build(fresh, umask=0)  # even with a permissive umask
    for d in (tmp_path / "fresh" / "cache", lib.parent):
        assert d.stat().st_mode & 0o077 == 0, oct(d.stat().st_mode)
    lib.parent.chmod(0o775)  # an entry of ours that others could write into: rebuilt from scratch
    (lib.parent / "planted.so").write_bytes(b"")
    assert _load(fresh) == "42"
    assert lib.parent.stat().st_mode & 0o077 == 0 and not (lib.parent / "planted.so").exists()


def test_a_planted_lock_symlink_is_not_followed(tiny_op, tmp_path):
    spec, env, _ = tiny_op
    entry = builder.private_cache_root() / f"tiny-{builder.cache_key(spec)}"
    entry.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (entry / ".lock").symlink_to(victim)
    with pytest.raises(builder.OpBuildError, match=r"\.lock is a symbolic link"):
        builder.build(spec)
    assert victim.read_text() == "precious\n"  # open(..., "w") used to follow the link and truncate it

"""dsrun/env.py: the one place DSRUN_* variables are read (see [Note: environment variables]).

Three kinds of checks: every DSRUN_ name in dsrun/ is declared there and no
other module reads one from the environment (an AST walk); each reader
accepts its documented forms and rejects the rest with an error naming the
variable; and the table on docs/config.md is the module's.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsrun import env
from tests.docs.test_docs import load_hooks

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsrun"
ENV_MODULE = PACKAGE / "env.py"
# A DSRUN_ name: not the tail of a longer identifier such as _DSRUN_OPTIMIZERS.
NAME = re.compile(r"(?<![A-Za-z0-9_])DSRUN_[A-Z0-9_]*[A-Z0-9]")


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(PACKAGE.rglob("*")) if p.is_file() and p.suffix in (".py", ".cpp", ".h",
                                                                                                   ".cu", ".md")}


def test_every_dsrun_name_in_the_package_is_declared():
    used = {name: path for path, text in _sources().items() for name in NAME.findall(text)}
    undeclared = {name: str(path.relative_to(ROOT)) for name, path in used.items() if name not in env.VARIABLES}
    assert not undeclared, f"declare these in dsrun/env.py: {undeclared}"


DECLARED = {name: var.name for name, var in vars(env).items() if isinstance(var, env.EnvVar)}


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "DSRUN_..."` (or `NAME = <declaration>.name`) constants of a module."""
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        if isinstance(value, ast.Attribute) and value.attr == "name" and isinstance(value.value, ast.Name):
            value = ast.Constant(DECLARED.get(value.value.id))
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out.update({t.id: value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _package_constants() -> dict[str, str]:
    """Every dsrun module's DSRUN_ constants by name (a constant may be imported elsewhere, as
    STRICT_ENV is), and each dsrun.env declaration's name (`PROGRESS.name` names DSRUN_PROGRESS)."""
    out = dict(DECLARED)
    for path, text in _sources().items():
        if path.suffix == ".py":
            out.update(_constants(ast.parse(text)))
    return out


def environment_reads(source: str, known: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """(line, name) of every read of a DSRUN_ variable in `source` that bypasses dsrun.env.

    A read is `<mapping>.get(K)`, `getenv(K)`, `<mapping>[K]` (not assigned
    to) or `K in <mapping>`, where K is a DSRUN_ string, a constant holding
    one (this module's or, by name, `known`'s) or `<declaration>.name`;
    writing `os.environ[K] = v` or building an env dict is not a read."""
    tree = ast.parse(source)
    consts = {**(known or {}), **_constants(tree)}

    def dsrun_name(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant):
            value = node.value
        elif isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Name):
            value = consts.get(node.value.id)
        else:
            value = consts.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith("DSRUN_") else None

    reads = []
    for node in ast.walk(tree):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("get", "getenv", "pop", "setdefault"):
                keys = [node.args[0]]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            keys = [node.slice]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            keys = [node.left]
        reads += [(node.lineno, name) for name in map(dsrun_name, keys) if name]
    return reads


def test_no_module_but_dsrun_env_reads_a_dsrun_variable():
    known = _package_constants()
    found = {f"{path.relative_to(ROOT)}:{line}": name for path, text in _sources().items()
             if path.suffix == ".py" and path != ENV_MODULE for line, name in environment_reads(text, known)}
    assert not found, f"read these through dsrun.env: {found}"


def test_the_walk_finds_the_reads_it_forbids():
    source = '''
import os
VAR = "DSRUN_X"
os.environ.get("DSRUN_A", "1")
os.getenv(VAR)
environ = dict(os.environ)
flag = environ["DSRUN_B"]
if "DSRUN_C" in os.environ:
    pass
os.environ["DSRUN_D"] = "1"
child = {"DSRUN_E": "1"}
os.environ.get(STRICT_ENV)
os.environ.get(PROGRESS.name)
'''
    known = {"STRICT_ENV": "DSRUN_STRICT_CONFIG", "PROGRESS": "DSRUN_PROGRESS"}
    assert environment_reads(source, known) == [(4, "DSRUN_A"), (5, "DSRUN_X"), (7, "DSRUN_B"), (8, "DSRUN_C"),
                                                (12, "DSRUN_STRICT_CONFIG"), (13, "DSRUN_PROGRESS")]


def test_the_module_imports_without_torch():
    code = "import sys, dsrun.env, dsrun.launcher.progress; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("var,raw,value", [
    (env.MALLOC, "0", False), (env.MALLOC, " 1 ", True), (env.MALLOC, "", True), (env.PROGRESS, None, False),
    (env.HOST_CACHE_MB, "0", 0), (env.HOST_CACHE_MB, "512", 512), (env.HOST_CACHE_MB, None, None),
    (env.CKPT_TIMEOUT, "2.5", 2.5), (env.CKPT_BARRIER_TIMEOUT, None, 120.0), (env.RENDEZVOUS_TIMEOUT, None, None),
    (env.ZERO_WATCHDOG_TIMEOUT, "0", 0.0), (env.PROGRESS_INTERVAL, "0", 0.0),
    (env.COMM_OVERLAP, "sync", "sync"), (env.COMM_OVERLAP, None, "thread"), (env.CPU_ISA, None, None),
    (env.OPS_CACHE, "/tmp/ops cache", Path("/tmp/ops cache")), (env.OPS_CACHE, "~/c", Path("~/c")),
    (env.OPS_DISABLE, "aio, shm_comm,", frozenset({"aio", "shm_comm"})), (env.OPS_DISABLE, None, frozenset()),
    (env.JOB_ID, "dsrun-20261126-abc", "dsrun-20261126-abc"), (env.JOB_ID, "  ", None),
])
def test_readers_parse_the_documented_forms(var, raw, value):
    assert var.read({} if raw is None else {var.name: raw}) == value


@pytest.mark.parametrize("var,raw,words", [
    (env.MALLOC, "yes", "expected 0 or 1"), (env.STRICT_CONFIG, "true", "expected 0 or 1"),
    (env.HOST_CACHE_MB, "-1", "whole number"), (env.HOST_CACHE_MB, "1.5", "whole number"),
    (env.CKPT_TIMEOUT, "0", "> 0"), (env.SHM_TIMEOUT, "-3", "> 0"), (env.RENDEZVOUS_TIMEOUT, "inf", "> 0"),
    (env.RENDEZVOUS_TIMEOUT, "nan", "> 0"), (env.CKPT_BARRIER_TIMEOUT, "2m", "number of seconds"),
    (env.ZERO_WATCHDOG_TIMEOUT, "-1", ">= 0"),
    (env.COMM_OVERLAP, "async", "expected one of sync, thread, torch"), (env.CPU_ISA, "sse9", "expected one of"),
    (env.OPS_DISABLE, "aio;quantizer", "comma-separated names"),
])
def test_bad_values_raise_naming_the_variable_and_the_value(var, raw, words):
    with pytest.raises(env.EnvVarError) as e:
        var.read({var.name: raw})
    assert f"{var.name}={raw!r}" in str(e.value) and words in str(e.value)
    assert isinstance(e.value, ValueError)  # callers that caught ValueError before still do


def test_reads_follow_os_environ_at_call_time(monkeypatch):
    monkeypatch.setenv("DSRUN_HOST_CACHE_MB", "7")
    assert env.HOST_CACHE_MB.read() == 7
    monkeypatch.delenv("DSRUN_HOST_CACHE_MB")
    assert env.HOST_CACHE_MB.read() is None


def test_call_sites_raise_the_readers_errors(monkeypatch):
    """Three callers: the message is the reader's, the exception type the caller's own."""
    import datetime

    from dsrun.runtime.distributed import rendezvous
    from dsrun.runtime.comm import collectives
    from dsrun.runtime.zero.watchdog import Watchdog

    monkeypatch.setenv("DSRUN_RENDEZVOUS_TIMEOUT", "soon")
    with pytest.raises(rendezvous.RendezvousError, match="DSRUN_RENDEZVOUS_TIMEOUT='soon'"):
        rendezvous.rendezvous_timeout(datetime.timedelta(seconds=5))
    monkeypatch.setenv("DSRUN_COMM_OVERLAP", "async")
    with pytest.raises(ValueError, match="DSRUN_COMM_OVERLAP='async'"):
        collectives.overlap_mode()
    monkeypatch.setenv("DSRUN_ZERO_WATCHDOG_TIMEOUT", "-2")
    with pytest.raises(ValueError, match="DSRUN_ZERO_WATCHDOG_TIMEOUT='-2'"):
        Watchdog(rank=0)
    monkeypatch.setenv("DSRUN_ZERO_WATCHDOG_TIMEOUT", "45")
    assert Watchdog(rank=0).timeout == 45.0


def test_checkpoint_timeouts_are_read_at_import(tmp_path):
    code = ("from dsrun.runtime.checkpoint import rendezvous as r; "
            "print(r.ARRIVAL_TIMEOUT_S, r.COMMIT_TIMEOUT_S)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path),
                                        "DSRUN_CKPT_BARRIER_TIMEOUT": "7", "DSRUN_CKPT_TIMEOUT": "90.5"})
    assert out.stdout.split() == ["7.0", "90.5"], out.stderr


def _table_rows(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if line.startswith("| `DSRUN_")}


def test_docs_page_table_is_the_modules():
    # The site's table of DSRUN_* variables is generated by docs/hooks.py; rendered, it holds
    # exactly the rows of dsrun.env.markdown_table(), under the page's "Environment variables".
    rendered = load_hooks().on_page_markdown((ROOT / "docs" / "config.md").read_text())
    table = rendered[rendered.index("## Environment variables"):]
    assert _table_rows(table) == _table_rows(env.markdown_table())
    assert len(_table_rows(table)) == len(env.VARIABLES)


def test_docs_page_generates_the_table():
    page = (ROOT / "docs" / "config.md").read_text()
    assert "<!-- generated: environment-variables -->" in page
    assert load_hooks().on_page_markdown(page).count("| `DSRUN_") == len(env.VARIABLES)

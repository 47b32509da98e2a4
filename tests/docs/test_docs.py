"""The documentation site builds in strict mode, and its generated pages follow the code."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsrun.runtime import config
from tests.examples.test_readme import schema_paths

ROOT = Path(__file__).resolve().parents[2]


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_lists_every_key_of_the_schema():
    hooks = load_hooks()
    text = hooks.config_reference()
    leaves = {p for p in schema_paths(config.DsConfig)
              if not any(q.startswith(p + ".") for q in schema_paths(config.DsConfig))}
    documented = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}
    assert documented == leaves
    rejected = hooks.not_yet_supported()
    assert all(f"`{e.path}`" in rejected for e in config.NOT_YET_SUPPORTED)
    assert all(f"`{k}`" in hooks.no_effect() for k in config.NO_EFFECT_YET)


def build(docs_root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(docs_root / "mkdocs.yml"),
                           "-d", str(site)], cwd=docs_root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.slow
def test_the_site_builds_strictly_and_a_broken_link_fails_it(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    config_page = (tmp_path / "site" / "config" / "index.html").read_text()
    assert "flops_profiler.recompute_fwd_factor" in config_page  # generated from the schema
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert 'id="dsrun.runtime.engine.engine.Engine.backward"' in api  # from the docstrings
    assert not (tmp_path / "site" / "hooks.py").exists()

    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "zero.md"
    page.write_text(page.read_text() + "\nSee [the old page](no-such-page.md).\n")
    broken = build(copy, tmp_path / "site2")
    assert broken.returncode != 0 and "no-such-page.md" in broken.stderr

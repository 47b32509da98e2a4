"""README.md and the docs pages it points to stay true to the code and to CI.

The README is one page: the two commands, the shortest training script, the
launcher in a few lines and a table of the docs pages. The tables that must
follow the code moved to docs/: the launcher's options (docs/launcher.md),
the config keys that take effect and the rejected ones (docs/config.md).
When one of these fails, the code changed and the page did not (or the
other way round): update the page's table or list to match.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import yaml
from pydantic import BaseModel

from dsrun.launcher.cli import cli
from dsrun.runtime import config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def page(name: str) -> str:
    """The text of docs/<name>."""
    return (DOCS / name).read_text()


def section(text: str, start: str, end: str) -> str:
    """`text` from the first occurrence of `start` up to the next occurrence of `end`."""
    begin = text.index(start)
    return text[begin:text.index(end, begin)]


def schema_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every dotted key path of a config model, sections included."""
    paths = set()
    for name, field in model.model_fields.items():
        paths.add(prefix + name)
        inner = field.annotation
        inner = next((a for a in getattr(inner, "__args__", ()) if isinstance(a, type)), inner)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            paths |= schema_paths(inner, f"{prefix}{name}.")
    return paths


def first_column(text: str) -> list[str]:
    """The first cell of every markdown table row in `text`, header and rule rows left out."""
    return [line.split(" | ")[0].lstrip("| ") for line in text.splitlines() if line.startswith("| `")]


def test_launcher_table_lists_every_dsrun_option():
    table = section(page("launcher.md"), "| option | meaning |", "## Hostfiles")
    documented = {opt for cell in first_column(table) for opt in re.findall(r"--[a-z_]+", cell)}
    actual = {opt for p in cli.params if isinstance(p, click.Option) for opt in p.opts if opt.startswith("--")}
    actual.discard("--help")
    assert documented == actual


def test_rejected_list_matches_the_not_yet_supported_registry():
    rejected = section(page("config.md"), "Rejected loudly", "## Every key")
    documented = set(re.findall(r"`([a-z_0-9.]+)`", rejected))
    expected = {entry.path for entry in config.NOT_YET_SUPPORTED} | set(config._DEEPSPEED_ONLY_KEYS)
    assert documented == expected


def test_config_table_and_accepted_keys_are_real_keys():
    paths = schema_paths(config.DsConfig)
    documented = set()
    config_page = page("config.md")
    for cell in first_column(section(config_page, "## Keys that take effect", "## Accepted, and rejected")):
        bases = re.findall(r"`([a-z_0-9.]+)`", cell)
        fields = re.findall(r"`\{([^}]*)\}`", cell)
        documented |= set(bases)
        documented |= {f"{bases[-1]}.{f.strip()}" for group in fields for f in group.split(",")}
    assert documented, "no config table found"
    assert documented <= paths, f"not in the config schema: {sorted(documented - paths)}"
    accepted = set(re.findall(r"`([a-z_0-9.]+)`", section(config_page, "Every other DeepSpeed key", "Rejected loudly")))
    unknown = {k for k in accepted if not any(p == k or p.endswith("." + k) for p in paths)}
    assert not unknown, f"not in the config schema: {sorted(unknown)}"


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc extension gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def test_readme_quick_start_runs_the_ci_test_command():
    # .ci/run runs the README's test command on a clean clone; the Makefile defines it.
    quick_start = section(README, "## Quick start", "## Using dsrun")
    ci_commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line.strip() and not line.lstrip().startswith("#")]
    assert "make test" in ci_commands
    assert re.search(r"^    make test\s", quick_start, re.M), "README's quick start no longer shows `make test`"
    assert re.search(r"^    make demo\s", quick_start, re.M)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:", makefile, re.M) and re.search(r"^demo:", makefile, re.M)
    demo = re.search(r"^demo:.*\n\t(.*)$", makefile, re.M).group(1)
    shown = re.search(r"^    (\.venv/bin/dsrun .*)$", quick_start, re.M).group(1)
    assert shlex.split(demo.replace("$(VENV)", ".venv")) == shlex.split(shown)


def test_readme_is_one_page():
    assert len(README.splitlines()) <= 300, "README.md is the newcomer's one page: move details to docs/"


def test_readme_links_reach_pages_of_the_site_and_their_headings():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(entries):
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from pages(value) if isinstance(value, list) else [value]

    in_nav = set(pages(nav))
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", README)
    assert len(links) >= 20, "README's table of docs pages is gone"
    for target, anchor in links:
        name = target.removeprefix("docs/")
        assert (DOCS / name).is_file(), f"README links to {target}, which does not exist"
        assert name in in_nav, f"README links to {target}, which is not in mkdocs.yml's nav"
        if anchor:
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", page(name), re.M)}
            assert anchor in headings, f"README links to {target}#{anchor}: no such heading"
    linked = {target.removeprefix("docs/") for target, _ in links}
    assert in_nav - {"index.md"} <= linked, f"pages missing from README's table: {sorted(in_nav - linked - {'index.md'})}"

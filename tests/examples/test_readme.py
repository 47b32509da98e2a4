"""README.md stays true to the code: launcher options, config keys, rejected features.

When one of these fails, the code changed and the README did not (or the
other way round): update the README's table or list to match.
"""
from __future__ import annotations

import re
from pathlib import Path

import click
from pydantic import BaseModel

from dsrun.launcher.cli import cli
from dsrun.runtime import config

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def section(start: str, end: str) -> str:
    """The README's text from the line containing `start` up to the next line containing `end`."""
    begin = README.index(start)
    return README[begin:README.index(end, begin)]


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
    table = section("## The launcher", "Every rank gets")
    documented = {opt for cell in first_column(table) for opt in re.findall(r"--[a-z_]+", cell)}
    actual = {opt for p in cli.params if isinstance(p, click.Option) for opt in p.opts if opt.startswith("--")}
    actual.discard("--help")
    assert documented == actual


def test_rejected_list_matches_the_not_yet_supported_registry():
    rejected = section("Rejected loudly", "## Repository layout")
    documented = set(re.findall(r"`([a-z_0-9.]+)`", rejected))
    expected = {entry.path for entry in config.NOT_YET_SUPPORTED} | set(config._DEEPSPEED_ONLY_KEYS)
    assert documented == expected


def test_config_table_and_accepted_keys_are_real_keys():
    paths = schema_paths(config.DsConfig)
    documented = set()
    for cell in first_column(section("Keys that take effect", "Every other DeepSpeed key")):
        bases = re.findall(r"`([a-z_0-9.]+)`", cell)
        fields = re.findall(r"`\{([^}]*)\}`", cell)
        documented |= set(bases)
        documented |= {f"{bases[-1]}.{f.strip()}" for group in fields for f in group.split(",")}
    assert documented, "no config table found"
    assert documented <= paths, f"not in the config schema: {sorted(documented - paths)}"
    accepted = set(re.findall(r"`([a-z_0-9.]+)`", section("Every other DeepSpeed key", "Rejected loudly")))
    unknown = {k for k in accepted if not any(p == k or p.endswith("." + k) for p in paths)}
    assert not unknown, f"not in the config schema: {sorted(unknown)}"

"""MkDocs hook: pages generated from the code, so they cannot drift from it.

A page containing `<!-- generated: config-reference -->` gets the config
reference (every key of dsrun.runtime.config.DsConfig with its type,
default and description), `<!-- generated: not-yet-supported -->` the keys
that are rejected, `<!-- generated: no-effect -->` the keys accepted without
effect, `<!-- generated: environment-variables -->` the table of DSRUN_*
variables (dsrun.env), `<!-- generated: combinations -->` the table of
which settings combine (dsrun.runtime.parallel.combinations). Used by mkdocs.yml (`hooks:`); tests/docs imports it too.
"""
from __future__ import annotations

import json
import typing
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from dsrun import env
from dsrun.runtime import config as config_module
from dsrun.runtime.config import NO_EFFECT_YET, NOT_YET_SUPPORTED, DsConfig
from dsrun.runtime.parallel import combinations as combinations_module


def _type_name(field: FieldInfo) -> str:
    base, _meta, nullable = config_module._unwrap(field.annotation)
    if typing.get_origin(base) is typing.Literal:
        text = " \\| ".join(json.dumps(a) for a in typing.get_args(base))
    elif isinstance(base, type):
        text = base.__name__
    else:
        text = str(base).replace("typing.", "")
    return f"{text} or null" if nullable else text


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return json.dumps(value) if not isinstance(value, BaseModel) else "{}"


def sections(model: type[BaseModel] = DsConfig, prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted path, model) of the top level and of every nested section, depth first."""
    yield prefix.rstrip("."), model
    for name, field in model.model_fields.items():
        inner = config_module._model_of(field)
        if inner is not None:
            yield from sections(inner, f"{prefix}{name}.")


def _status(path: str) -> str:
    rejected = [e for e in NOT_YET_SUPPORTED if e.path == path]
    if rejected:
        return f" **Rejected** when set (not built: {rejected[0].feature})."
    if path in NO_EFFECT_YET:
        return f" Accepted without effect (dsrun behaves as `{json.dumps(NO_EFFECT_YET[path])}`; warns otherwise)."
    return ""


def config_reference() -> str:
    """Markdown: one table per config section, every key of the schema."""
    out = []
    for path, model in sections():
        leaves = [(n, f) for n, f in model.model_fields.items() if config_module._model_of(f) is None]
        title = f"`{path}`" if path else "Top-level keys"
        out.append(f"### {title}\n")
        doc = (model.__doc__ or "").strip().splitlines()[0]
        if path:
            out.append(doc + "\n")
        aliases = getattr(model, "_ALIASES", {})
        if isinstance(aliases, dict) and aliases:
            out.append("Old names accepted: " + ", ".join(f"`{a}` = `{b}`" for a, b in aliases.items()) + ".\n")
        if not leaves:
            continue
        out.append("| key | type | default | meaning |\n|---|---|---|---|")
        for name, field in leaves:
            key = f"{path}.{name}" if path else name
            desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{key}` | {_type_name(field)} | `{_default(field)}` | {desc}{_status(key)} |")
        out.append("")
    return "\n".join(out)


def not_yet_supported() -> str:
    """Markdown list of the settings rejected with a ConfigError."""
    lines = [f"- `{e.path}`: {e.feature} ({e.fix})" for e in NOT_YET_SUPPORTED]
    lines += [f"- `{key}`: {what} (a DeepSpeed section dsrun does not have)"
              for key, what in config_module._DEEPSPEED_ONLY_KEYS.items()]
    return "\n".join(lines)


def no_effect() -> str:
    """Markdown list of the keys accepted without effect."""
    return "\n".join(f"- `{path}` (dsrun behaves as `{json.dumps(value)}`)" for path, value in NO_EFFECT_YET.items())


def combinations() -> str:
    """Markdown: the settings, then every pair of the combination table
    (refused ones with reason and fix, working ones with their test)."""
    table = combinations_module.TABLE
    out = ["| setting | turned on by |", "|---|---|"]
    out += [f"| `{name}` | {how} |" for name, how in combinations_module.SETTINGS.items()]
    out += ["", "#### Refused pairs", "", "| setting | setting | why | what to change |", "|---|---|---|---|"]
    rows = sorted((sorted(pair), entry) for pair, entry in table.items())
    out += [f"| `{a}` | `{b}` | {e.reason} | {e.fix} |" for (a, b), e in rows
            if isinstance(e, combinations_module.Refused)]
    out += ["", "#### Pairs that work", "", "| setting | setting | trained by |", "|---|---|---|"]
    for (a, b), e in rows:
        if isinstance(e, combinations_module.Works):
            test = f"`{e.test}`" if e.test else "works (untested)"
            out.append(f"| `{a}` | `{b}` | {test} |")
    return "\n".join(out)


GENERATORS = {"config-reference": config_reference, "not-yet-supported": not_yet_supported,
              "no-effect": no_effect, "environment-variables": env.markdown_table,
              "combinations": combinations}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    for name, generate in GENERATORS.items():
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown

"""What DeepSpeed accepts beyond the schema: "auto" placeholders, its legacy
forms and foreign keys (see [Note: DeepSpeed's forms and foreign keys])."""
from __future__ import annotations

import difflib
import warnings
from typing import Any

from pydantic import (
    BaseModel,
)

from dsrun.env import STRICT_CONFIG
from dsrun.runtime.config.errors import ConfigWarning
from dsrun.runtime.config.messages import _model_of
from dsrun.runtime.config.schema import _DEEPSPEED_ONLY_KEYS

def _pop_auto(node: Any, path: str) -> list[str]:
    """Remove every "auto" value from `node` (in place); return their key paths.

    [Note: "auto" values]
    Hugging Face's Trainer writes "auto" into ds_configs and replaces it
    with real numbers before DeepSpeed sees them. A config with "auto"
    given straight to DeepSpeed is silently wrong (nested values dropped,
    DeepSpeed #1270); here each one is an error. They are removed after
    being reported so that they do not also show up as type errors.
    """
    found = []
    if isinstance(node, dict):
        for key in list(node):
            sub = f"{path}.{key}" if path else str(key)
            if isinstance(node[key], str) and node[key].strip().lower() == "auto":
                del node[key]
                found.append(sub)
            else:
                found.extend(_pop_auto(node[key], sub))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found.extend(_pop_auto(item, f"{path}[{i}]"))
    return found


def _auto_problem(path: str) -> str:
    return (f"{path}: \"auto\" is a placeholder that the Hugging Face Trainer integration fills in; "
            f"when calling dsrun directly, replace it with a value")


# ---------------------------------------------------------------------------
# DeepSpeed's forms and foreign keys

STRICT_ENV = STRICT_CONFIG.name

# Keys a section accepts besides its fields and _ALIASES (read by its "before" validators).
_LEGACY_KEYS: dict[str, set[str]] = {"ZeroConfig": {"cpu_offload", "cpu_offload_param",
                                                    "cpu_offload_use_pin_memory"},
                                     "ElasticityConfig": {"prefer_large_batch"}}


def _disabled(section: Any) -> bool:
    """True for `{}`, `false` or a section whose `"enabled"` is false and whose
    subsections enable nothing (`{"enabled": false, "x": {"enabled": false}}`)."""
    if section is False or section == {}:
        return True
    if not isinstance(section, dict) or section.get("enabled") is not False:
        return False
    return all(_disabled(v) or not isinstance(v, dict) for k, v in section.items() if k != "enabled")


def _deepspeed_forms(data: dict) -> None:
    """Rewrite DeepSpeed's accepted forms in place (see [Note: DeepSpeed's forms and foreign keys]).

    [Note: DeepSpeed's forms and foreign keys]
    Real configs carry what DeepSpeed accepts without acting on it, and
    Hugging Face injects some of it: sections of features dsrun lacks that
    say `"enabled": false` (`hybrid_engine`, `amp`, `nebula`, ... are
    dropped, because they do nothing in DeepSpeed either; any other value
    of such a section is still rejected, naming the feature. The legacy `"zero_optimization": true` means stage 1 (false:
    stage 0). Keys DeepSpeed does not know at all, which it ignores, are
    treated by _drop_foreign_keys: a likely typo of a known key is an error
    with its "did you mean"; any other unknown key warns, naming it, and is
    dropped; DSRUN_STRICT_CONFIG=1 (or load_config(strict=True)) makes
    every unknown key an error.
    """
    for key in _DEEPSPEED_ONLY_KEYS:
        if key in data and _disabled(data[key]):
            del data[key]
    if isinstance(data.get("zero_optimization"), bool):
        data["zero_optimization"] = {"stage": 1 if data["zero_optimization"] else 0}


def _drop_foreign_keys(node: dict, model: type[BaseModel], path: str, strict: bool, source: str) -> None:
    """Drop (with one ConfigWarning) the unknown keys of `node` and its
    sections that are not a likely typo; typos and, when `strict`, every
    unknown key stay for validation to report."""
    dropped = _foreign_keys(node, model, path, strict)
    if dropped:
        warnings.warn(f"{source}: unknown keys ignored, as DeepSpeed ignores them: {', '.join(dropped)} "
                      f"(set {STRICT_ENV}=1 to make unknown keys errors)", ConfigWarning, stacklevel=3)


def _foreign_keys(node: dict, model: type[BaseModel], path: str, strict: bool) -> list[str]:
    aliases = getattr(model, "_ALIASES", {})
    known = [*model.model_fields, *aliases, *_LEGACY_KEYS.get(model.__name__, ())]
    if not path:
        known += list(_DEEPSPEED_ONLY_KEYS)
    dropped = []
    for key in list(node):
        sub = f"{path}.{key}" if path else str(key)
        name = aliases.get(key, key)
        if name in model.model_fields:
            inner = _model_of(model.model_fields[name])
            if inner is not None and isinstance(node[key], dict):
                dropped += _foreign_keys(node[key], inner, sub, strict)
        elif key not in known and not strict and not difflib.get_close_matches(str(key), known, n=1, cutoff=0.8):
            del node[key]
            dropped.append(sub)
    return dropped



"""pydantic's validation errors translated into one line per problem a user can act on."""
from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
)
from pydantic.fields import FieldInfo

from dsrun.runtime.config.errors import _Problem
from dsrun.runtime.config.schema import _DEEPSPEED_ONLY_KEYS, DsConfig
from dsrun.runtime.config.sections import _unwrap

def _bounds(meta: list) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for item in meta:
        for name in ("ge", "gt", "le", "lt"):
            if getattr(item, name, None) is not None:
                found[name] = getattr(item, name)
    return found


def _describe(field: FieldInfo, item: bool = False) -> str:
    """What a field accepts, in words: 'an integer 0-3', "one of 'none', 'cpu'", ...

    With `item`, what one element of the field (a list) accepts.
    """
    tp, meta, nullable = _unwrap(field.annotation)
    if item and typing.get_origin(tp) is list:
        element = (typing.get_args(tp) or (str,))[0]
        if typing.get_origin(element) is Literal:
            return "one of " + ", ".join(repr(v) for v in typing.get_args(element))
        return "a string"
    b = _bounds([*field.metadata, *meta])
    if tp is bool:
        text = "true or false"
    elif tp in (int, float):
        noun = "an integer" if tp is int else "a number"
        b = {k: f"{v:g}" for k, v in b.items()}
        if "ge" in b and "le" in b:
            text = f"{noun} {b['ge']}-{b['le']}"
        elif tp is int and b.get("ge") == "1":
            text = "a positive integer"
        else:
            limits = [f"{sym} {b[k]}" for k, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                      if k in b]
            text = " ".join([noun, *limits])
    elif typing.get_origin(tp) is Literal:
        text = "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    elif typing.get_origin(tp) is list:
        text = "a list of strings"
    elif typing.get_origin(tp) is dict:
        text = "an object (key: value mapping)"
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        keys = list(tp.model_fields)
        text = "an object with keys such as " + ", ".join(keys[:4])
    elif tp is Path:
        text = "a path (string)"
    else:
        text = "a string"
    return text + " or null" if nullable else text


def _model_of(field: FieldInfo | None) -> type[BaseModel] | None:
    if field is None:
        return None
    tp = _unwrap(field.annotation)[0]
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _translate(error: dict) -> str:
    """One pydantic error -> one line starting with the dotted key path."""
    model: type[BaseModel] | None = DsConfig
    field: FieldInfo | None = None
    parts: list[str] = []
    loc = list(error["loc"])
    if error["type"] == "extra_forbidden":
        loc, key = loc[:-1], str(loc[-1])
    for part in loc:
        if model is not None and isinstance(part, str) and part in model.model_fields:
            field = model.model_fields[part]
            parts.append(part)
            model = _model_of(field)
        elif isinstance(part, int):
            parts.append(f"[{part}]")
    path = ".".join(parts).replace(".[", "[")

    if error["type"] == "extra_forbidden":
        return _unknown_key(path, key, model)
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, _Problem):
        full = ".".join(p for p in (path, cause.key) if p)
        return f"{full}: {cause.text}"
    if error["type"] == "missing":
        return f"{path}: missing; expected {_describe(field)}" if field else f"{path}: missing"
    if field is None:  # a failure of the top-level object itself
        return f"{error['msg']}"
    in_list = bool(loc) and isinstance(loc[-1], int)
    return f"{path}: expected {_describe(field, item=in_list)}, got {error['input']!r}"


def _unknown_key(section: str, key: str, model: type[BaseModel] | None) -> str:
    where = f"{section}.{key}" if section else key
    if not section and key in _DEEPSPEED_ONLY_KEYS:
        return f"{key}: {_DEEPSPEED_ONLY_KEYS[key]} is a DeepSpeed feature that dsrun does not implement; " \
               f"remove the '{key}' section"
    valid = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    scope = f"in {section}" if section else "at the top level"
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
    return f"{where}: unknown key '{key}' {scope}; {hint}"

"""Reading a config file: JSON or YAML, duplicate keys refused."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from dsrun.runtime.config.errors import ConfigError

class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads 5e8 / 1e-3 as numbers.

    PyYAML follows YAML 1.1, where a float needs a dot: `lr: 1e-3` would be
    the string "1e-3". YAML 1.2 and JSON read it as a number, and so do we.
    """


def _construct_mapping(loader: _YamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _compose_node(loader: _YamlLoader, parent, index):
    """Refuse aliases (`*name`) before they are expanded: nested aliases grow
    a few lines into gigabytes (a "billion laughs" file took 45 s and 3 GB)."""
    if loader.check_event(yaml.events.AliasEvent):
        event = loader.peek_event()
        raise yaml.composer.ComposerError(
            None, None, f"YAML alias *{event.anchor} is not allowed in a dsrun config; write the value "
            "out where it is used", event.start_mark)
    return yaml.composer.Composer.compose_node(loader, parent, index)


_YamlLoader.compose_node = _compose_node
_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                  list("-+0123456789"))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _read_file(path: Path) -> Any:
    """Parse a JSON or YAML (.yaml/.yml) file; raise ConfigError naming the file and position."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {what} (looked for {path.resolve()})", source=str(path))
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"not valid UTF-8: byte 0x{data[exc.start]:02x} at line {line} (byte offset "
                          f"{exc.start}); save the file as UTF-8", source=str(path)) from None
    if not text.strip():
        raise ConfigError("the config file is empty; write a JSON object or YAML mapping such as "
                          '{"train_batch_size": 8}', source=str(path))
    try:
        return _parse(path, text)
    except RecursionError:
        raise ConfigError("nested more than a few hundred levels deep; a ds_config has at most 3 levels of "
                          "sections", source=str(path)) from None


def _parse(path: Path, text: str) -> Any:
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            value = yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"not valid YAML{where}: {problem}", source=str(path)) from None
        if value is None:
            raise ConfigError("the config file has no keys (only comments or an empty document); write a "
                              "YAML mapping such as 'train_batch_size: 8'", source=str(path))
        return value
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                          source=str(path)) from None
    except ValueError as exc:
        raise ConfigError(f"not valid JSON: {exc}", source=str(path)) from None

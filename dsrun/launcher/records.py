"""Dataclass records that travel between the head and the agents as one line of JSON.

[Note: no pydantic in the agent]
Every node's agent starts once per node and job, before any rank of that
node can start. Its job (`NodeJob`) and its reports (`RankFailure`,
`HangReport`) were pydantic models; importing pydantic and building their
schemas cost each agent about 0.1 CPU-s, a fifth of a simulated node's
whole start-up (bench/launcher/README.md, "Where a node's CPU goes"). So
these records are plain dataclasses, written with `json` and read back
with `parse_record`. `NodeJob`, the agent's input, checks its fields in
`__post_init__`; the reports are written by dsrun's own agent and parsed
only by its head, so reading one checks only that its fields are the
record's fields.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

T = TypeVar("T")


def record_json(record: Any) -> str:
    """`record` (a dataclass instance, nested ones included) as one line of compact JSON, no newline."""
    return json.dumps(dataclasses.asdict(record), separators=(",", ":"))


def parse_record(cls: type[T], data: Any, error: type[ValueError] = ValueError) -> T:
    """Build dataclass `cls` from `data`: a JSON text, or the dict that one decodes to.

    Nested records are left as dicts: `cls.__post_init__` or the caller converts them.

    Raises:
        `error` (a ValueError): `data` is not valid JSON, not a JSON object, or
            has a field `cls` lacks or lacks one `cls` requires.
    """
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise error(f"not a JSON {cls.__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"expected a JSON object for {cls.__name__}, got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    unknown = sorted(set(data) - {f.name for f in fields})
    missing = [f.name for f in fields if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if unknown or missing:
        raise error(f"{cls.__name__}: unknown fields {unknown}, missing fields {missing} "
                    "(head and agent from different dsrun versions?)")
    return cls(**data)


class LineRecord:
    """A dataclass record that travels as one line: its class's `LINE_PREFIX`, then `record_json`.

    The prefix lets a reader pick records out of a stream that carries
    other output (an agent's stdout/stderr beside its ranks' lines).
    """

    LINE_PREFIX = ""  # set by each record class

    def to_line(self) -> str:
        """The record as one prefixed line (no newline)."""
        return self.LINE_PREFIX + record_json(self)

    @classmethod
    def from_line(cls: type[T], line: str) -> T | None:
        """Parse a line written by `to_line`; None if the line lacks the class's prefix.

        Raises:
            ValueError: the line has the prefix but is not this record (see `parse_record`).
        """
        if not line.startswith(cls.LINE_PREFIX):
            return None
        return parse_record(cls, line[len(cls.LINE_PREFIX):])

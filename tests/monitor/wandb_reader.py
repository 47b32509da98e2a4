"""Read the history rows of an offline W&B run file (run-*.wandb), for the tests.

The file is a LevelDB-style log (what wandb's own former reader,
wandb/sdk/internal/datastore.py, parsed): a 7-byte file header (":W&B",
magic 0xBEE1, version), then 32 KiB blocks of chunks, each a 7-byte header
(CRC-32, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4) and its bytes; a block
tail shorter than a chunk header is padding. Each reassembled record is a
serialized wandb Record protobuf.
"""
from __future__ import annotations

import json
import struct

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32768
_HEADER = 7


def records(path: str) -> list[pb.Record]:
    data = open(path, "rb").read()
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B run file"
    out, pos, pending = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left  # zero padding to the block end
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(path: str) -> list[dict]:
    """Each logged row as {"_step": step, name: value, ...}."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            rows.append(row)
    return rows


def run_info(path: str) -> pb.RunRecord:
    """The run record (project, group, entity)."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")

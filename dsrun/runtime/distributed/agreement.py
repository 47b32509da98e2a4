"""Before training starts, every rank checks that all ranks built the same job.

`initialize` calls `check_ranks_agree` right after reading the config and
before any other collective. Ranks that silently disagree -- a different
model (`Linear(4, 2)` on one rank, `Linear(4, 3)` on another), another ZeRO
stage, a config file that differs per node -- would otherwise exchange
buffers of different sizes and train to garbage, or fail later with a
message that blames the wrong rank.

[Note: rank agreement protocol]
1. Each rank builds two texts: the config (every resolved key, one
   "path = value" line each, or its ConfigError's message when the config is
   invalid on that rank) and the model (one "name shape dtype requires_grad"
   line per parameter; zero.Init shards count with their full shape).
2. One all_gather of a fixed-size uint8 record per rank: a status byte (config
   valid or not) and the SHA-256 of each text (65 bytes). No pickling and no
   NumPy: object collectives need NumPy, which a plain install lacks.
3. Only when some digests differ are the texts themselves exchanged
   (`all_gather_bytes`: the lengths, then the padded bytes), so the error
   can name the first line where rank 0 and the first differing rank part.
Every rank sees the same gathered records, so every rank takes the same
branch and raises at the same point: none is left waiting in a collective.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from dsrun.runtime import comm
from dsrun.runtime.config import ConfigError, DsConfig

_DIGEST = 32  # bytes of SHA-256
_RECORD = 1 + 2 * _DIGEST


class RankMismatchError(ValueError):
    """Ranks built different models (names, shapes, dtypes, requires_grad)."""


def all_gather_bytes(data: bytes, device: torch.device, group=None) -> list[bytes]:
    """Every rank's `data`, in rank order (collective over `group`).

    Two tensor all_gathers on `device` (the backend's: cuda under NCCL):
    the lengths (int64 [world]), then the bytes padded to the longest
    (uint8 [world * longest]). Small control data only: every rank holds
    world x the longest payload.
    """
    world = comm.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(lengths, length, group=group)
    longest = int(lengths.max())
    mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    out = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    comm.all_gather_into_tensor(out, mine, group=group)
    rows = out.view(world, -1).cpu()
    return [bytes(rows[r, :int(lengths[r])].tolist()) for r in range(world)]


def model_description(module: torch.nn.Module) -> list[str]:
    """One line per parameter: "name shape dtype requires_grad" (zero.Init
    shards are described by their full shape, `ds_shape`)."""
    lines = []
    for name, p in module.named_parameters():
        shape = tuple(getattr(p, "ds_shape", p.shape))
        dtype = str(p.dtype).replace("torch.", "")
        lines.append(f"{name} shape={shape} dtype={dtype} requires_grad={p.requires_grad}")
    return lines


def _flatten(value: Any, path: str, out: list[str]) -> None:
    if isinstance(value, dict):
        for key in sorted(value):
            _flatten(value[key], f"{path}.{key}" if path else str(key), out)
    else:
        out.append(f"{path} = {json.dumps(value, sort_keys=True, default=str)}")


def config_description(cfg: DsConfig) -> list[str]:
    """One "dotted.key = value" line per resolved config key, sorted."""
    out: list[str] = []
    _flatten(cfg.model_dump(mode="json"), "", out)
    return out


def _digest(lines: list[str]) -> bytes:
    return hashlib.sha256("\n".join(lines).encode()).digest()


def _first_difference(a: list[str], b: list[str]) -> tuple[str, str]:
    """The first differing line of two descriptions (or "(nothing)" past the shorter's end)."""
    for x, y in zip(a, b):
        if x != y:
            return x, y
    n = min(len(a), len(b))
    return (a[n] if n < len(a) else "(nothing more)"), (b[n] if n < len(b) else "(nothing more)")


def _differing(texts: list[str], what: str) -> str:
    """The sentence naming rank 0's line and the first differing rank's line."""
    lines = [t.split("\n") for t in texts]
    other = next(r for r in range(1, len(lines)) if lines[r] != lines[0])
    mine, theirs = _first_difference(lines[0], lines[other])
    return (f"the {what} differs between ranks: rank 0 has '{mine}', rank {other} has '{theirs}' "
            f"(first difference); every rank must build the same {what}")


def _shown_by_rank0(error: ConfigError, rank: int, world: int) -> None:
    """Mark an error every rank has identically: rank 0 prints it, the others
    stay quiet (see [Note: one message per job] in dsrun/runtime/observability/exit_report.py)."""
    if rank == 0:
        error.quiet_ranks = world - 1
    else:
        error.shown_by_rank = 0


def check_ranks_agree(module: torch.nn.Module, cfg: DsConfig | None,
                      error: ConfigError | None, rank: int, device: torch.device,
                      description: list[str] | None = None) -> None:
    """Raise on every rank unless all ranks hold a valid config, the same
    resolved config and the same model (see [Note: rank agreement protocol]).
    Collective over the default group; call it on every rank before any
    other collective of training.

    Args:
        module: the model about to be trained.
        cfg: this rank's resolved config, or None when it was invalid.
        error: the ConfigError this rank got instead of a config, or None.
        rank: this rank's global rank.
        device: where the backend's collectives run (cuda:N under NCCL).
        description: what must be equal about the model on every rank
            (default: `model_description(module)`; a pipeline stage passes
            the whole pipeline's layer list, since each rank holds other layers).

    Raises:
        ConfigError: some rank's config is invalid (each invalid rank raises
            its own; when every rank has the same problem, ranks other than
            0 mark theirs as shown by rank 0, see `dsrun.runtime.observability.exit_report`),
            or the resolved configs differ (naming the first differing key).
        RankMismatchError: the models differ (naming the first parameter).
    """
    world = comm.get_world_size()
    if world == 1:
        if error is not None:
            raise error
        return
    config_text = (str(error) if error is not None else "\n".join(config_description(cfg)))
    model_text = "\n".join(description if description is not None else model_description(module))
    record = bytes([0 if error is not None else 1]) + _digest([config_text]) + _digest([model_text])
    mine = torch.tensor(list(record), dtype=torch.uint8, device=device)
    gathered = torch.empty(world * _RECORD, dtype=torch.uint8, device=device)
    comm.all_gather_into_tensor(gathered, mine)
    gathered = gathered.cpu()
    rows = [bytes(gathered[r * _RECORD:(r + 1) * _RECORD].tolist()) for r in range(world)]
    invalid = [r for r, row in enumerate(rows) if row[0] == 0]
    configs_equal = all(row[1:1 + _DIGEST] == rows[0][1:1 + _DIGEST] for row in rows)
    if invalid:
        if error is None:
            raise ConfigError(f"rank {rank}: the config is invalid on rank(s) {invalid} (see their "
                              "messages); every rank must get the same valid config")
        if len(invalid) == world and configs_equal:
            _shown_by_rank0(error, rank, world)  # the same message: rank 0 prints it for the job
        raise error
    if not configs_equal:
        texts = [b.decode() for b in all_gather_bytes(config_text.encode(), device)]
        problem = ConfigError(_differing(texts, "resolved config"))
        _shown_by_rank0(problem, rank, world)
        raise problem
    if any(row[1 + _DIGEST:] != rows[0][1 + _DIGEST:] for row in rows):
        texts = [b.decode() for b in all_gather_bytes(model_text.encode(), device)]
        raise RankMismatchError(f"rank {rank}: " + _differing(texts, "model (parameter names, shapes, "
                                                              "dtypes, requires_grad)"))

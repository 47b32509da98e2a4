"""`dsrun-ckpt`: look into, verify and export dsrun checkpoints (one process, no torch.distributed).

    dsrun-ckpt inspect DIR                       tags, complete or not, world size, stage, precision, size
    dsrun-ckpt verify DIR [--tag TAG]            sizes and checksums of every file; names the first bad one
    dsrun-ckpt export DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
    dsrun-ckpt import-deepspeed DIR OUT [--tag TAG]   a DeepSpeed checkpoint in dsrun's format

`export` writes the Hugging Face layout: `model.safetensors`, or
`model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json` when
the model exceeds --max-shard-size, with the module's own parameter names.
It streams: one tensor is read (from its stored slices), cast and written at
a time, so its memory is bounded by the largest tensor, not the model.
"""
from __future__ import annotations

import functools
import json
import os
import click
import torch
from rich.console import Console
from rich.table import Table

from dsrun.runtime.checkpoint.reader import SliceReader
from dsrun.runtime.checkpoint.store import (INDEX, LATEST, CheckpointError, atomic_write,
                                            dtype_of, fsync_dir, load_index, resolve_tag, stream_safetensors,
                                            tag_is_complete, tag_names, verify_file)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes (KB/MB/GB/TB decimal, KiB/MiB/GiB binary, plain number: bytes).
    Raises click.BadParameter."""
    t = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                return int(float(t[:-len(unit)]) * _UNITS[unit])
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size such as 5GB or 500MB") from None


def _reported(fn):
    """Turn CheckpointError into a one-line click error (exit code 1)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CheckpointError as e:
            raise click.ClickException(str(e)) from None
    return wrapper


def _tag_dir(directory: str, tag: str | None) -> str:
    found, skipped = resolve_tag(directory, tag)
    for t in skipped:
        click.echo(f"skipping incomplete tag {t} (no {INDEX})", err=True)
    if found is None:
        raise click.ClickException(f"no complete dsrun checkpoint in {directory}")
    return os.path.join(directory, found)


@click.group()
def main() -> None:
    """Inspect, verify and export dsrun checkpoints."""


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@_reported
def inspect(directory: str) -> None:
    """List the tags in DIRECTORY."""
    latest = None
    if os.path.isfile(os.path.join(directory, LATEST)):
        with open(os.path.join(directory, LATEST)) as f:
            latest = f.read().strip()
    table = Table(title=directory)
    for col in ("tag", "complete", "ranks", "stage", "precision", "step", "tensors", "size (MB)"):
        table.add_column(col)
    for tag in tag_names(directory):
        tag_dir = os.path.join(directory, tag)
        size = sum(os.path.getsize(os.path.join(tag_dir, f)) for f in os.listdir(tag_dir))
        name = f"{tag} (latest)" if tag == latest else tag
        if not tag_is_complete(tag_dir):
            table.add_row(name, "no", "", "", "", "", "", f"{size / 1e6:.1f}")
            continue
        index = load_index(tag_dir)
        table.add_row(name, "yes", str(index.world_size), str(index.stage), index.precision,
                      str(index.counters.get("global_steps", "")), str(len(index.tensors)), f"{size / 1e6:.1f}")
    Console().print(table)


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--tag", default=None, help="Tag to verify (default: latest, else the newest complete one).")
@_reported
def verify(directory: str, tag: str | None) -> None:
    """Check every file of a tag against the size and checksum in its index
    (XXH3-128, or sha256 for checkpoints of earlier dsrun versions)."""
    tag_dir = _tag_dir(directory, tag)
    index = load_index(tag_dir)
    for file, entry in sorted(index.files.items()):
        verify_file(tag_dir, file, entry)  # CheckpointError naming the file: exit 1
    algorithms = sorted({entry.algorithm for entry in index.files.values()})
    click.echo(f"{tag_dir}: {len(index.files)} files OK ({', '.join(algorithms)})")


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--tag", default=None, help="Tag to export (default: latest, else the newest complete one).")
@click.option("--dtype", type=click.Choice(sorted(_DTYPES)), default="fp32", show_default=True,
              help="dtype of floating tensors in the export.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output file.")
@_reported
def export(directory: str, out: str, tag: str | None, dtype: str, max_shard_size: str) -> None:
    """Write the model weights of a tag in Hugging Face's safetensors layout."""
    files = export_hf(_tag_dir(directory, tag), out, _DTYPES[dtype], parse_size(max_shard_size))
    click.echo(f"wrote {len(files)} file(s) to {out}")


@main.command("import-deepspeed")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--tag", default=None, help="DeepSpeed tag to convert (default: the one its `latest` names).")
@_reported
def import_deepspeed_cmd(directory: str, out: str, tag: str | None) -> None:
    """Convert a DeepSpeed checkpoint (ZeRO 0-3, fp32/bf16/fp16) into dsrun's format in OUT.

    DeepSpeed's pickles are read restrictively: tensors, plain containers and
    an allow-list of four DeepSpeed classes; anything else is refused.
    """
    from dsrun.runtime.checkpoint.deepspeed_import import import_deepspeed

    new = import_deepspeed(directory, out, tag)
    Console().print(f"wrote {new} (load it with engine.load_checkpoint({out!r}) on any world size and stage)")


def export_hf(tag_dir: str, out: str, dtype: torch.dtype, max_shard_bytes: int) -> list[str]:
    """Export the module tensors of `tag_dir` to `out` (see the module
    docstring); floating tensors are cast to `dtype`, others kept. Returns the
    written file names. Raises CheckpointError naming a bad input file."""
    index = load_index(tag_dir)
    reader = SliceReader(tag_dir, index)
    specs = []
    for gname, entry in index.tensors.items():
        if gname.startswith("module/"):
            stored = dtype_of(entry.dtype)
            out_dtype = dtype if stored.is_floating_point else stored
            specs.append((gname[len("module/"):], tuple(entry.shape), out_dtype))
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = torch.Size(spec[1]).numel() * torch.empty((), dtype=spec[2]).element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    os.makedirs(out, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    total = 0  # tensor bytes, as Hugging Face counts them
    for name, shard in zip(names, shards):
        values = (reader.read_full("module/" + key).to(dt).view(shape) for key, shape, dt in shard)
        atomic_write(os.path.join(out, name), stream_safetensors(shard, values, {"format": "pt"}))
        total += sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                     for _, shape, dt in shard)
    if len(shards) > 1:
        weight_map = {key: name for name, shard in zip(names, shards) for key, _, _ in shard}
        text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        atomic_write(os.path.join(out, "model.safetensors.index.json"), [text.encode()])
    fsync_dir(out)
    return names


if __name__ == "__main__":
    main()

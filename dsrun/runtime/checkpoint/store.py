"""The on-disk format of a dsrun checkpoint: files, index, tags, atomic writes.

    save_dir/
      latest                              text: the tag of the last committed save
      <tag>/rank00000-of-00002.safetensors  rank 0's slices (1-D tensors)
      <tag>/rank00001-of-00002.safetensors
      <tag>/index.json                    the Index below; written last

Format version 2 records each file's checksum as {"algorithm", "checksum",
"bytes"} (XXH3-128 for new saves, see [Note: checkpoint checksums] in
checksum.py); version 1 (earlier dsrun) recorded {"sha256", "bytes"} and is
still read.

No pickle anywhere: tensors are safetensors, everything else is JSON. A
shard holds 1-D slices keyed by global name ("module/h.0.fc.weight",
"optim/h.0.fc.weight/exp_avg", "rng/torch_cpu", "client/<path>"); the index
says, for each global tensor, its shape, dtype and which [lo, hi) of its
flattened elements each (file, key) holds. Each rank also stores its own
description in its shard's safetensors header (`__metadata__["dsrun"]`), so
rank 0 builds the index from the headers without moving any data.

[Note: commit protocol]
1. Every rank checks that every rank called save, and ranks agree at each
   step below, through the rendezvous store with bounded waits (see [Note:
   arrival check] in checkpointer.py): a dead rank makes the others fail
   instead of hanging. Rank 0 removes `<tag>/index.json` if the tag exists
   (overwriting a tag makes it incomplete first, never inconsistent) and
   moves its old shards aside (deleted in the background: [Note: deletion
   off the save's path] in discard.py) before any rank writes.
2. Every rank writes its shard to a temporary name in the tag directory,
   fsyncs and renames it, hashing it as it goes (writer.py).
3. All ranks publish (success, the file's checksum); if any rank failed, every rank
   raises, `latest` stays unchanged and the tag's files go: every rank
   deletes its shard, and rank 0 the tag directory if this save created it
   (see [Note: a failed save leaves no files] in save.py; a failure at
   step 4 or 5 does the same, the index deleted first).
4. Rank 0 reads the shard headers, writes index.json (temporary name,
   fsync, rename, directory fsync), then replaces `latest` the same way
   (and prunes old tags for checkpoint.keep_last: index first, then the
   files, moved aside and deleted in the background).
   With checkpoint.use_node_local_storage rank 0 builds the index from the
   ranks' reports instead of the headers, and each node's local rank 0
   writes its copy (see [Note: node-local checkpoints] in node_local.py).
5. A final agreement: save returns (or, with async_save, the background
   job ends) on every rank only once the tag is committed.
A tag directory without index.json is never loaded; loading without a tag
follows `latest`, or else takes the complete tag with the newest index, and
names every incomplete tag it skipped. A crash at any point leaves either the
old state or the new one under the final names, never a half-written file.
"""
from __future__ import annotations

import ctypes
import json
import os
import struct
from typing import Any, Iterable

import torch
from pydantic import BaseModel, Field, model_validator

from dsrun.runtime.checkpoint import checksum

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: files carry a sha256 only
INDEX = "index.json"
LATEST = "latest"
# Hidden directories of old files being deleted (see discard.py); never tags.
TRASH_PREFIX = ".dsrun-deleting-"

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64",
              torch.int16: "I16", torch.bool: "BOOL"}
_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file/key."""


class StoredSlice(BaseModel):
    """Elements [lo, hi) of a flattened global tensor, stored as `key` in `file`."""

    file: str = Field(description="Shard file name inside the tag directory.")
    key: str = Field(description="safetensors key of the 1-D slice.")
    lo: int = Field(description="First element (of the flattened global tensor).")
    hi: int = Field(description="One past the last element.")


class TensorEntry(BaseModel):
    """One global tensor: its shape and dtype and where its elements are."""

    shape: list[int] = Field(description="Global shape.")
    dtype: str = Field(description="Stored dtype: torch name without 'torch.' (float32, bfloat16, ...).")
    slices: list[StoredSlice] = Field(default_factory=list, description="Disjoint slices, any order.")


class FileEntry(BaseModel):
    """One file of a tag: its size and checksum (see [Note: checkpoint checksums])."""

    algorithm: str = Field(description="Checksum algorithm: xxh3_128 (new saves) or sha256 (format 1).")
    checksum: str = Field(description="Hex digest of the whole file.")
    bytes: int = Field(description="File size.")

    @model_validator(mode="before")
    @classmethod
    def _format_1(cls, data: Any) -> Any:
        """Format 1 wrote {"sha256": hex, "bytes": n}."""
        if isinstance(data, dict) and "sha256" in data and "checksum" not in data:
            data = {k: v for k, v in data.items() if k != "sha256"} | {"algorithm": "sha256",
                                                                        "checksum": data["sha256"]}
        return data


class NodeRecord(BaseModel):
    """A node that saved a checkpoint on node-local storage (see [Note:
    node-local checkpoints] in node_local.py)."""

    host: str = Field(description="Host name of the node's local rank 0.")
    ranks: list[int] = Field(description="Global ranks on the node, in order.")


class Index(BaseModel):
    """index.json: everything a load needs besides the tensor bytes."""

    format_version: int = FORMAT_VERSION
    tag: str
    saved_at_ns: int = Field(0, description="time.time_ns() when rank 0 wrote the index: orders tags.")
    dsrun_version: str
    torch_version: str
    world_size: int = Field(description="Ranks that wrote the checkpoint.")
    pipeline_stages: int = Field(1, description="Parts (pipeline stages) the model was split into; 1: "
                                 "every rank held the whole model.")
    tensor_parallel: int = Field(1, description="Tensor-parallel ranks (the mesh's model axis) that wrote "
                                 "it; tensors are stored whole whatever it was.")
    sequence_parallel: int = Field(1, description="Sequence-parallel ranks (the mesh's sequence axis) that "
                                   "wrote it; with the world size, stages and tensor_parallel it fixes every "
                                   "rank's place in the mesh, which per-rank RNG states belong to.")
    stage: int = Field(description="ZeRO stage it was written at.")
    precision: str = Field(description="fp32, bf16 or fp16 (compute dtype).")
    config: dict[str, Any] = Field(description="The resolved ds_config.")
    tensors: dict[str, TensorEntry] = Field(description="Global name -> shape, dtype, slices.")
    optimizer_scalars: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Parameter name -> {state key: {'value', 'dtype' (None: a "
        "Python number)}} for 0-dim optimizer states (Adam's step).")
    param_groups: list[dict[str, Any]] = Field(default_factory=list,
                                               description="Optimizer hyperparameters per group, no 'params'.")
    group_of: dict[str, int] = Field(default_factory=dict, description="Parameter name -> optimizer group.")
    scaler: dict[str, Any] | None = None
    counters: dict[str, int] = Field(default_factory=dict)
    lr_scheduler: dict[str, Any] | None = None
    dataloader: dict[str, int] | None = Field(None, description="The engine's loader position "
                                              "({'epoch', 'batches', 'samples'}: 'samples' over all data ranks, "
                                              "which another layout resumes from), if it has one.")
    states: dict[str, Any] = Field(default_factory=dict, description="The training parts' named states "
                                   "(TrainingParts.stateful: curriculum schedulers, ...), JSON data by name.")
    client_state: Any = None
    rng: list[dict[str, Any]] = Field(default_factory=list, description="Per rank: python/numpy states.")
    frozen: list[str] = Field(default_factory=list, description="Parameters with requires_grad=False.")
    excluded_frozen: list[str] = Field(default_factory=list,
                                       description="Frozen parameters left out (exclude_frozen_parameters).")
    files: dict[str, FileEntry] = Field(default_factory=dict)
    nodes: list[NodeRecord] | None = Field(None, description="With checkpoint.use_node_local_storage: the nodes "
                                           "that saved, by node id; None: one directory every rank saw.")
    written_on: dict[str, int] = Field(default_factory=dict, description="With node-local storage: file -> "
                                       "id of the node whose directory holds it.")


def shard_name(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


def is_shard_file(name: str) -> bool:
    """A rank's shard (any world size) or the temporary name it is written under."""
    return name.startswith(("rank", ".rank")) and ".safetensors" in name


def tag_names(save_dir: str) -> list[str]:
    """Every directory in save_dir that may be a tag (complete or not), sorted."""
    return sorted(d for d in os.listdir(save_dir)
                  if not d.startswith(TRASH_PREFIX) and os.path.isdir(os.path.join(save_dir, d)))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint index")
    return dtype


# ---- atomic writes -------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, chunks: Iterable[bytes | memoryview]) -> None:
    """Write `chunks` to `path` through a temporary name: write, fsync,
    rename (the directory is not fsynced here; see fsync_dir). On error the
    temporary file is removed."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def safetensors_header(specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                       metadata: dict[str, str] | None = None, align: int = 8) -> tuple[bytes, list[int]]:
    """The safetensors header (8-byte length + JSON) for tensors described by
    `specs` (key, shape, dtype), stored in that order, and each tensor's byte
    offset in the file. The JSON ends with spaces so that the data starts at
    a multiple of `align` bytes (a multiple of 8, as the format asks)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset, offsets = 0, []
    for key, shape, dtype in specs:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets.append(offset)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)
    raw = struct.pack("<Q", len(raw)) + raw
    return raw, [len(raw) + o for o in offsets]


def safetensors_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name ("F32", ...), None if unknown."""
    return _NAMES.get(name)


def follows(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether 1-D `b` starts right where 1-D `a` ends in the same storage."""
    return (a is not None and a.device == b.device and a.dtype == b.dtype
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr())


def joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One 1-D view covering `a` and `b` (1-D views of one storage, `b`
    right after `a`: see `follows`)."""
    return torch.empty(0, dtype=a.dtype, device=a.device).set_(
        a.untyped_storage(), a.storage_offset(), (a.numel() + b.numel(),))


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor without a copy and without NumPy
    (not installed by `pip install dsrun`); valid while `t` is alive."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())) if nbytes else memoryview(b"")


def stream_safetensors(specs: list[tuple[str, tuple[int, ...], torch.dtype]], values: Iterable[torch.Tensor],
                       metadata: dict[str, str] | None = None) -> Iterable[memoryview]:
    """safetensors bytes for tensors described up front by `specs` (key,
    shape, dtype) whose values arrive one at a time from `values` (same
    order): the header needs only the shapes, so at most one tensor is in
    memory at a time. Raises ValueError when a value does not match its spec."""
    yield memoryview(safetensors_header(specs, metadata)[0])
    for (key, shape, dtype), t in zip(specs, values, strict=True):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"tensor {key}: got {tuple(t.shape)} {t.dtype}, announced {shape} {dtype}")
        if t.numel():
            data = t.detach().contiguous().cpu().reshape(-1)
            yield byte_view(data)  # consumed before `data` goes out of scope


def write_json_atomic(path: str, data: Any) -> None:
    # no indent: json then uses its C encoder (an index lists every tensor slice)
    atomic_write(path, [json.dumps(data, separators=(",", ":")).encode()])
    fsync_dir(os.path.dirname(path) or ".")


def read_shard_metadata(path: str) -> dict[str, Any]:
    """This rank's description stored in a shard's safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return json.loads(header["__metadata__"]["dsrun"])


def verify_file(tag_dir: str, file: str, entry: FileEntry) -> None:
    """Check one file of a tag against its index entry: present, its size,
    then its checksum (streamed). Raises CheckpointError naming the file."""
    path = os.path.join(tag_dir, file)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    if size != entry.bytes:
        raise CheckpointError(f"checkpoint file {path} is truncated or altered: {size} bytes, "
                              f"the index recorded {entry.bytes}")
    try:
        digest = checksum.file_digest(path, entry.algorithm)
    except ValueError as e:
        raise CheckpointError(f"checkpoint file {path}: {e}") from None
    if digest != entry.checksum:
        raise CheckpointError(f"checkpoint file {path} is corrupted: its {entry.algorithm} checksum does not "
                              "match the index")


# ---- tags ----------------------------------------------------------------------
def tag_is_complete(tag_dir: str) -> bool:
    return os.path.isfile(os.path.join(tag_dir, INDEX))


def resolve_tag(load_dir: str, tag: str | None) -> tuple[str | None, list[str]]:
    """(tag to load or None when there is none, incomplete tags skipped).

    With `tag` given it is returned as is (load_index reports a missing or
    incomplete one). Without: the tag named by `latest` if complete, else the
    complete tag whose index is newest.
    """
    if tag is not None:
        return tag, []
    if not os.path.isdir(load_dir):
        return None, []
    tags = tag_names(load_dir)
    # A directory without an index is an incomplete tag when a save started in
    # it (shards or their temporaries); anything else there is not ours.
    incomplete = [t for t in tags if not tag_is_complete(os.path.join(load_dir, t))
                  and any(is_shard_file(f) for f in os.listdir(os.path.join(load_dir, t)))]
    tags = [t for t in tags if t in incomplete or tag_is_complete(os.path.join(load_dir, t))]
    latest = os.path.join(load_dir, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            named = f.read().strip()
        if named and tag_is_complete(os.path.join(load_dir, named)):
            return named, incomplete
    complete = [t for t in tags if t not in incomplete]
    if not complete:
        if os.path.isfile(latest):
            refuse_deepspeed(os.path.join(load_dir, named))
        return None, incomplete
    return max(complete, key=lambda t: index_time(os.path.join(load_dir, t))), incomplete


def index_time(tag_dir: str) -> int:
    """When a complete tag was committed (ns): its index's saved_at_ns, else
    the index file's mtime (an index that cannot be read counts as oldest)."""
    path = os.path.join(tag_dir, INDEX)
    try:
        with open(path) as f:
            return int(json.load(f).get("saved_at_ns") or os.stat(path).st_mtime_ns)
    except (OSError, ValueError):
        return -1


def refuse_deepspeed(tag_dir: str) -> None:
    """Raise CheckpointError saying how to convert, if `tag_dir` holds a DeepSpeed checkpoint."""
    if os.path.isdir(tag_dir) and any(f.endswith("model_states.pt") for f in os.listdir(tag_dir)):
        raise CheckpointError(f"{tag_dir} is a DeepSpeed checkpoint; convert it once with `dsrun-ckpt "
                              f"import-deepspeed {os.path.dirname(os.path.normpath(tag_dir)) or '.'} OUT` "
                              "and load OUT")


def load_index(tag_dir: str) -> Index:
    """The parsed index of a tag. Raises CheckpointError for a missing tag,
    a tag without index (incomplete save) or an unreadable index."""
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"checkpoint tag directory {tag_dir} does not exist")
    path = os.path.join(tag_dir, INDEX)
    if not os.path.isfile(path):
        refuse_deepspeed(tag_dir)
        raise CheckpointError(f"{tag_dir} has no {INDEX}: its save did not complete; it cannot be loaded")
    try:
        with open(path) as f:
            index = Index.model_validate_json(f.read())
    except ValueError as e:
        raise CheckpointError(f"{path} is not a valid dsrun checkpoint index: {e}") from None
    if index.format_version not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format version {index.format_version}, this dsrun reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))} (a newer dsrun wrote it?)")
    return index

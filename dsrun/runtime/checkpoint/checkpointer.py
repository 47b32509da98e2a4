"""Save and load an engine's complete training state (engine.save_checkpoint / load_checkpoint).

What is saved: the module (fp32 master values of trainable ZeRO parameters,
every other parameter and persistent buffer in its own dtype), optimizer
states (element-wise ones as tensor slices, 0-dim ones as JSON), optimizer
hyperparameters, the loss scaler, engine counters, the LR scheduler's
state_dict, client_state and every rank's RNG states. See store.py for the
format and [Note: commit protocol].

[Note: resharding on load]
The loader knows nothing about the layout that wrote a checkpoint. Under its
own current layout each rank lists the pieces it holds ([lo, hi) of the
flattened parameter `name`, see pieces.py: its ZeRO shards at stages 1-3,
whole tensors for replicated ones). For each piece it walks the stored
slices of "module/<name>" (and of "optim/<name>/<key>"), reads exactly the
overlap [max(lo, s.lo), min(hi, s.hi)) of each through safetensors'
`get_slice` (no whole-file load) and copies it, casting, into the master
(or the tensor itself). Any world size and any stage 0-3 or precision
therefore loads any other: a piece may come from one stored slice or from
several files. Masters are then cast into the compute copy and every rank's
full parameters re-gathered (`ZeroStrategy.after_checkpoint_load`).

[Note: replicated loads]
A tensor several ranks hold alike (stage 0: the whole model and its
optimizer states, in fp32 as plain tensors, in 16-bit as masters replicated
over ZeRO's replicate group; frozen parameters at stages 1-2; buffers)
would otherwise be read from the files by each of them: N ranks read a
stage-0 checkpoint N times, from one disk or one shared file system.
Instead each replica reads only its even part of such a piece (the part it
writes on save, `HeldPiece.write_lo/write_hi` under the current layout),
and once every rank has read without error (the load's "read" agreement)
each part is broadcast in the replica group from the rank that read it
(`_fill_replicated`; over shared memory when the group is the whole job on
one host). The bytes are copied, never reduced, so values stay bit for
bit. Loading a checkpoint that N ranks wrote at stage 0 on the same N
ranks, rank r then reads exactly its own file. 2 ranks, 48M GPT, stage 0
(bench/checkpoint/README.md): rank 0 reads 287 MB per load instead of
575; the load's time, alternated with the old way, went 0.60-0.62 ->
0.52-0.62 s in fp32 (within the noise) and 0.68-0.75 -> 0.51-0.61 s in
bf16; the ~600 broadcasts (one per part) take 0.08-0.19 s of it.
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import dsrun
from dsrun.runtime import comm
from dsrun.runtime.checkpoint import discard
from dsrun.runtime.checkpoint.pieces import HeldPiece, even_part, plain_pieces
from dsrun.runtime.checkpoint.reader import SliceReader
from dsrun.runtime.checkpoint.store import (INDEX, LATEST, CheckpointError, FileEntry, Index,
                                            StoredSlice, TensorEntry, atomic_write, dtype_name, dtype_of,
                                            fsync_dir, index_time, is_shard_file, load_index,
                                            read_shard_metadata, resolve_tag, shard_name, stream_safetensors,
                                            tag_is_complete, tag_names, write_json_atomic)
from dsrun.runtime.checkpoint.writer import ShardWriter, StagingBuffer
from dsrun.runtime.config import STRICT_ENV
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer
from dsrun.runtime.zero.groups import RankGroup
from dsrun.runtime.zero.params import record_of
from dsrun.runtime.zero.strategy import ZeroStrategy

log = logging.getLogger("dsrun.checkpoint")

# Seconds a save/load waits for every rank to arrive before it fails (instead
# of hanging when called on some ranks only). DSRUN_CKPT_BARRIER_TIMEOUT overrides.
ARRIVAL_TIMEOUT_S = float(os.environ.get("DSRUN_CKPT_BARRIER_TIMEOUT", "120"))
# Seconds a rank waits for the others to finish writing (a dead rank makes the
# others fail after this). DSRUN_CKPT_TIMEOUT overrides.
COMMIT_TIMEOUT_S = float(os.environ.get("DSRUN_CKPT_TIMEOUT", "1800"))

# Tests set this to a function called with a point name ("before_shard",
# "after_shard", "before_index", "before_latest") to inject failures.
fault_hook: Callable[[str], None] | None = None


def _fault(point: str) -> None:
    if fault_hook is not None:
        fault_hook(point)


# ---- pieces of the engine ------------------------------------------------------
def held_pieces(engine) -> list[HeldPiece]:
    """Every piece of the module this rank holds (ZeRO-managed and plain)."""
    strategy, topo = engine.strategy, engine.topology
    pieces: list[HeldPiece] = []
    managed: set[int] = set()
    if isinstance(strategy, ZeroStrategy):  # the one switch: ZeRO pieces come from the strategy
        pieces = strategy.checkpoint_pieces()
        managed = {id(p) for p in strategy.managed_params()}
    world = RankGroup(None, topo.rank, topo.world_size)
    return pieces + plain_pieces(engine.module, engine.optimizer, managed, world)


def _global_names(engine) -> dict[str, tuple[int, ...]]:
    """Name -> global shape of every parameter and persistent buffer, and
    whether it is frozen (all ranks agree: read from the module)."""
    out = {}
    for name, p in engine.module.named_parameters():
        rec = record_of(p)
        out[name] = (tuple(rec.shape) if rec is not None else tuple(p.shape), not p.requires_grad)
    for mod_name, mod in engine.module.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{bname}" if mod_name else bname] = (tuple(buf.shape), False)
    return out


# ---- agreement among ranks -------------------------------------------------------
_generations: dict[str, int] = {}


class _Backoff:
    """Sleeps between polls of the store: 0.1 ms at first, doubling to 5 ms,
    so that ranks arriving together agree in well under a millisecond (an
    asynchronous save's call waits on two agreements) without a busy loop
    when one rank is slow."""

    def __init__(self):
        self.delay = 1e-4

    def __call__(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 0.005)


class Rendezvous:
    """Agreement among the ranks of one checkpoint call, through the rendezvous
    store, never through a collective.

    [Note: arrival check]
    A collective cannot time out on every rank (gloo's monitored_barrier
    bounds the wait on rank 0 only; NCCL has nothing), and an asynchronous
    save must not issue collectives from its thread while training issues
    its own. So ranks agree through the key-value store torch.distributed was
    initialised with (its TCPStore), under keys naming the call, the step and
    a per-process generation (repeated calls stay apart); not the tag, which
    the ranks only agree on afterwards (`agree_on_location`):

    - arrival: every rank adds 1 to a counter and polls it until it reaches
      the world size. After ARRIVAL_TIMEOUT_S a rank takes its 1 back (so a
      later, matched call is not miscounted) and raises; if the count was
      complete at that moment, it proceeds.
    - `agree(step, ok, report)`: every rank publishes (success, a string:
      after writing, its file's size and checksum as JSON) and
      waits up to COMMIT_TIMEOUT_S for all the others: a rank that died (or
      hangs in I/O) makes the others raise, naming it, instead of waiting
      forever.

    A single process (world size 1, or torch.distributed not initialised)
    agrees with itself. Raises CheckpointError.
    """

    def __init__(self, engine, what: str, tag: str | None):
        self.what = what
        self.rank, self.world = engine.topology.rank, engine.topology.world_size
        self.store = None
        if self.world == 1 or not comm.is_initialized():
            return
        from torch.distributed import distributed_c10d

        self.store = distributed_c10d._get_default_store()
        base = f"dsrun/ckpt/{what}/{engine.global_steps}"
        generation = _generations.get(base, 0)
        _generations[base] = generation + 1
        self.base = f"{base}/{generation}"
        self._arrive(tag, engine.global_steps)

    def _arrive(self, tag: str | None, step: int) -> None:
        key = f"{self.base}/arrived"
        count = self.store.add(key, 1)
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        pause = _Backoff()
        while count < self.world:
            if time.monotonic() > deadline:
                count = self.store.add(key, -1)
                if count + 1 >= self.world:  # the last rank arrived just now: go on
                    self.store.add(key, 1)
                    return
                raise CheckpointError(f"{self.what} must be called on every rank: only {count + 1} of "
                                      f"{self.world} ranks called it (tag {tag!r}, step {step}) within "
                                      f"{ARRIVAL_TIMEOUT_S:g} s")
            pause()
            count = self.store.add(key, 0)

    def agree(self, step: str, ok: bool, report: str = "") -> list[tuple[bool, str]]:
        """Every rank's (success, report) for `step`, in rank order."""
        if self.store is None:
            return [(ok, report)]
        keys = [f"{self.base}/{step}/{r}" for r in range(self.world)]
        self.store.set(keys[self.rank], f"{int(ok)}:{report}")
        deadline = time.monotonic() + COMMIT_TIMEOUT_S
        pause = _Backoff()
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise CheckpointError(f"{self.what}: rank(s) {missing} did not report within "
                                      f"{COMMIT_TIMEOUT_S:g} s ({step}); did they die?")
            pause()
        out = []
        for key in keys:
            flag, _, report = self.store.get(key).decode().partition(":")
            out.append((flag == "1", report))
        return out


def _raise_unless_all(results: list[tuple[bool, str]], error: BaseException | None, what: str) -> None:
    if error is not None:
        raise error
    bad = [r for r, (ok, _) in enumerate(results) if not ok]
    if bad:
        reports = "; ".join(f"rank {r}: {results[r][1]}" for r in bad if results[r][1])
        raise CheckpointError(f"{what} failed on rank(s) {bad}" + (f": {reports}" if reports else
                                                                   " (their own error is raised there)"))


# How a rank wants a difference between ranks' directories or tags handled,
# mildest first; the strictest any rank asks for applies.
_HANDLING = ("ignore", "warn", "error")


def _handling(checkpoint_cfg) -> dict[str, str]:
    """This rank's handling of a differing directory ("dir") and tag: "error"
    under DSRUN_STRICT_CONFIG=1 or `checkpoint.strict_paths`; a tag also
    follows DeepSpeed's `checkpoint.tag_validation` ("Fail": error,
    "Ignore": no warning); otherwise "warn"."""
    strict = checkpoint_cfg.strict_paths or os.environ.get(STRICT_ENV, "") == "1"
    tag = {"Fail": "error", "Ignore": "ignore"}.get(checkpoint_cfg.tag_validation, "warn")
    return {"dir": "error" if strict else "warn", "tag": "error" if strict else tag}


def agree_on_location(rdv: Rendezvous, checkpoint_cfg, dir_arg: str, directory: str | os.PathLike,
                      tag: str | None) -> tuple[str, str | None]:
    """The directory and tag every rank of one save or load uses: rank 0's
    when the ranks' differ (see [Note: agreed location]). Call it on every
    rank, right after `rdv` is made and before touching any file.

    Args:
        rdv: the call's rendezvous (its "location" agreement is used).
        checkpoint_cfg: the engine's `checkpoint` config section.
        dir_arg: the directory's argument name for messages ("save_dir",
            "load_dir").
        directory: this rank's directory, as passed.
        tag: this rank's tag (None on load: the latest).

    Returns:
        (directory, tag): this rank's own when every rank's resolve to the
        same absolute directory and tag, else rank 0's absolute directory
        and tag (the same on every rank).

    Raises:
        CheckpointError: on every rank, naming each differing rank and its
            value, when they differ and some rank asked for strictness
            (DSRUN_STRICT_CONFIG=1, `checkpoint.strict_paths`, or
            `checkpoint.tag_validation` "Fail" for the tag).

    [Note: agreed location]
    save_dir / load_dir and the tag are collective arguments, like a
    collective's shape: if ranks name different tag directories, each writes
    its shard into its own and the commit fails looking for the others'
    (DeepSpeed leaves a checkpoint that cannot be loaded). Scripts that name
    the directory after the clock (DeepSpeedExamples' bing_bert builds it
    with time.strftime on each rank) hit this whenever the ranks straddle a
    second. So each rank publishes through the store (`rdv.agree`, before
    any file is touched) its absolute directory (ranks in different working
    directories differ too), its tag, and how it wants a difference handled
    (`_handling`). Every rank reads the same records and takes the same
    branch: no difference -> each keeps its own arguments; a difference
    that the strictest handling any rank asked for makes an error -> the
    same CheckpointError on every rank; otherwise every rank uses rank 0's
    directory and tag, and rank 0 logs one warning naming each differing
    rank and its value. client_state is not compared: only rank 0's is
    saved, whatever the other ranks pass.
    """
    mine = {"dir": os.path.abspath(os.fspath(directory)), "tag": tag}
    record = json.dumps({"values": mine, "handling": _handling(checkpoint_cfg)})
    records = [json.loads(report) for _, report in rdv.agree("location", True, record)]
    first = records[0]["values"]
    differing = {key: [(r, rec["values"][key]) for r, rec in enumerate(records)
                       if rec["values"][key] != first[key]] for key in mine}
    if not any(differing.values()):
        return os.fspath(directory), tag
    how = {key: max((rec["handling"][key] for rec in records), key=_HANDLING.index) for key in mine}

    def describe(key: str, used: str) -> str:
        name = dir_arg if key == "dir" else "tag"
        ranks = ", ".join(f"rank {r} passed {name} {value!r}" for r, value in differing[key])
        return f"{ranks}, rank 0's {first[key]!r}{used}"
    errors = [key for key in mine if differing[key] and how[key] == "error"]
    if errors:
        raise CheckpointError(
            f"{rdv.what}: the ranks passed different arguments: "
            + "; ".join(describe(key, "") for key in errors)
            + f". Nothing was read or written; every rank must pass the same {dir_arg} and tag (without "
            f"{STRICT_ENV}=1, checkpoint.strict_paths or checkpoint.tag_validation \"Fail\", rank 0's are used)")
    warned = [describe(key, " is used") for key in mine if differing[key] and how[key] == "warn"]
    if warned and rdv.rank == 0:
        log.warning("%s: the ranks passed different arguments: %s", rdv.what, "; ".join(warned))
    return first["dir"], first["tag"]


# ---- JSON helpers ----------------------------------------------------------------
def _json_checked(value: Any, what: str) -> Any:
    """`value` round-tripped through JSON; CheckpointError naming the path of
    the first value JSON cannot hold (tuples become lists)."""
    def bad(obj):
        raise TypeError(type(obj).__name__)
    try:
        return json.loads(json.dumps(value, default=bad, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-serialisable ({e}); dsrun checkpoints hold no "
                              "pickles: use numbers, strings, lists and dicts with string keys") from None


def _encode_client(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """client_state with every tensor replaced by {"__tensor__": key,
    "shape": [...]} and stored (1-D) in `tensors`."""
    if isinstance(value, torch.Tensor):
        key = f"client/{path}"
        tensors[key] = value.detach().reshape(-1)
        return {"__tensor__": key, "shape": list(value.shape), "dtype": dtype_name(value.dtype)}
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise CheckpointError(f"client_state key {k!r} at {path or '<root>'} is not a string "
                                      "(JSON holds string keys only)")
        return {k: _encode_client(v, f"{path}.{k}" if path else k, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_client(v, f"{path}[{i}]", tensors) for i, v in enumerate(value)]
    return _json_checked(value, f"client_state at {path or '<root>'}")


def _decode_client(value: Any, reader: SliceReader) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return reader.read_full(value["__tensor__"]).view(value["shape"])
        return {k: _decode_client(v, reader) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_client(v, reader) for v in value]
    return value


def _python_rng() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(state), gauss]}
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return out


# ---- save ----------------------------------------------------------------------
def _rank_payload(engine, pieces: list[HeldPiece], client_state, exclude_frozen: bool):
    """This rank's tensors (key -> 1-D tensor), its description (JSON) and
    the keys of the tensors only an optimizer step changes (trainable values
    and their optimizer states: see [Note: copy-on-write snapshot] in writer.py)."""
    rank = engine.topology.rank
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    scalars: dict[str, dict] = {}
    stepped: set[str] = set()

    def put(gname: str, shape, t: torch.Tensor, lo: int, hi: int, by_step: bool = False) -> None:
        if hi > lo:
            tensors[gname] = t
            entries[gname] = {"shape": list(shape), "dtype": dtype_name(t.dtype), "lo": lo, "hi": hi}
            if by_step:
                stepped.add(gname)

    for p in pieces:
        if exclude_frozen and p.kind == "param" and not p.trainable:
            continue
        a, b = p.write_lo - p.lo, p.write_hi - p.lo
        put(f"module/{p.name}", p.shape, p.value[a:b], p.write_lo, p.write_hi, p.trainable)
        if p.state_key is None:
            continue
        for k, v in engine.optimizer.state.get(p.state_key, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == p.state_key.numel():
                flat = v.reshape(-1)
                put(f"optim/{p.name}/{k}", p.shape, flat[p.state_offset + a:p.state_offset + b],
                    p.write_lo, p.write_hi, True)
            elif isinstance(v, torch.Tensor) and v.dim() == 0:
                scalars.setdefault(p.name, {})[k] = {"value": v.item(), "dtype": dtype_name(v.dtype)}
            elif isinstance(v, (int, float, bool)):
                scalars.setdefault(p.name, {})[k] = {"value": v, "dtype": None}
            else:
                raise CheckpointError(f"optimizer state {k!r} of parameter {p.name} "
                                      f"({type(v).__name__}"
                                      f"{list(v.shape) if isinstance(v, torch.Tensor) else ''}) "
                                      "is neither element-wise nor a scalar; dsrun cannot checkpoint it yet")
    for gname, t in _optimizer_extras(engine.optimizer, rank).items():
        put(gname, [t.numel()], t.reshape(-1), 0, t.numel(), True)
    rng_key = f"rng/rank{rank}/torch_cpu"
    put(rng_key, [torch.get_rng_state().numel()], torch.get_rng_state(), 0, torch.get_rng_state().numel())
    if torch.cuda.is_available() and engine.device.type == "cuda":
        state = torch.cuda.get_rng_state(engine.device)
        put(f"rng/rank{rank}/cuda", [state.numel()], state, 0, state.numel())
    client = None
    if rank == 0:
        client_tensors: dict[str, torch.Tensor] = {}
        client = _encode_client(client_state, "", client_tensors)
        for key, t in client_tensors.items():
            put(key, [t.numel()], t, 0, t.numel())
    meta = {"rank": rank, "tensors": entries, "scalars": scalars, "rng": _python_rng(), "client_state": client}
    return tensors, meta, stepped


def save(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None,
         save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
    """Save the engine's state under save_dir/<tag>/ (collective: every rank).

    tag: default "global_step<N>" (engine.global_steps). Returns the tag
    directory. With `checkpoint.async_save` a background thread writes and
    commits (see [Note: copy-on-write snapshot] in writer.py); the call
    returns at once and the next save, load or `wait_pending` waits for it
    (and raises its error). save_dir and tag are rank 0's when ranks pass
    different ones (one warning; see `agree_on_location`); client_state is
    rank 0's, whatever the other ranks pass.
    Raises CheckpointError (on every rank) when a rank cannot write, state is
    not JSON-able (LR scheduler, client_state), not every rank called save,
    or ranks passed different save_dir/tag under strict checking (then
    before anything is written); `latest` and any earlier tag are then
    untouched. See [Note: commit protocol] in store.py.
    """
    wait_pending(engine)
    topo = engine.topology
    rank = topo.rank
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    rdv = Rendezvous(engine, "save_checkpoint", tag)
    save_dir, tag = agree_on_location(rdv, engine.config.checkpoint, "save_dir", save_dir, tag)
    if not tag or "/" in tag or tag in (".", "..", LATEST):
        raise CheckpointError(f"invalid checkpoint tag {tag!r}")
    tag_dir = os.path.join(save_dir, tag)
    error = None
    try:
        if rank == 0:
            os.makedirs(tag_dir, exist_ok=True)
            if os.path.exists(os.path.join(tag_dir, INDEX)):
                os.unlink(os.path.join(tag_dir, INDEX))  # overwriting: incomplete first, never mixed
                fsync_dir(tag_dir)
            old = [os.path.join(tag_dir, f) for f in os.listdir(tag_dir) if is_shard_file(f)]
            if old:  # any world size's; deleted in the background (see discard.py)
                discard.discard(save_dir, old)
        scheduler = None
        if engine.lr_scheduler is not None:
            scheduler = _json_checked(engine.lr_scheduler.state_dict(), "the LR scheduler's state_dict")
        param_groups = _json_checked([{k: v for k, v in g.items() if k != "params"}
                                      for g in engine.optimizer.param_groups], "optimizer param_groups")
        tensors, meta, stepped = _rank_payload(engine, held_pieces(engine), client_state or {},
                                               exclude_frozen_parameters)
        fields = _index_fields(engine, scheduler, param_groups, exclude_frozen_parameters) if rank == 0 else None
    except Exception as e:  # reported to every rank, then raised here
        error = e
    _raise_unless_all(rdv.agree("prepared", error is None), error, f"preparing checkpoint {tag_dir}")
    background = engine.config.checkpoint.async_save
    writer = ShardWriter(os.path.join(tag_dir, shard_name(rank, topo.world_size)), tensors,
                         {"dsrun": json.dumps(meta)}, stepped if background else set(tensors), engine.config.aio)
    staging = _staging(engine)
    writer.snapshot(staging)  # copies only what may change before the write reads it
    job = _SaveJob(rdv, save_dir, tag, writer, staging, fields, save_latest, engine.config.checkpoint.keep_last)
    if background:
        engine._pending_checkpoint = job.start()
    else:
        job.run()
    return tag_dir


def _staging(engine) -> StagingBuffer:
    """The engine's staging buffer, reused by all its saves."""
    if getattr(engine, "_checkpoint_staging", None) is None:
        engine._checkpoint_staging = StagingBuffer()
    return engine._checkpoint_staging


class _SaveJob:
    """Write one rank's shard and commit the tag (see [Note: commit protocol]);
    holds no reference to the engine, so it can run in a background thread."""

    def __init__(self, rdv: Rendezvous, save_dir: str, tag: str, writer: ShardWriter, staging: StagingBuffer,
                 fields: dict | None, save_latest: bool, keep_last: int | None):
        self.rdv, self.save_dir, self.tag = rdv, save_dir, tag
        self.tag_dir = os.path.join(save_dir, tag)
        self.writer, self.staging, self.fields = writer, staging, fields
        self.save_latest, self.keep_last = save_latest, keep_last
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.release_s = 0.0  # time the training thread spent in release()

    def release(self) -> None:
        """Called before an optimizer step: see [Note: copy-on-write snapshot]."""
        t = time.perf_counter()
        self.writer.release(self.staging)
        self.release_s += time.perf_counter() - t

    def start(self) -> "_SaveJob":
        def body():
            try:
                self.run()
            except BaseException as e:  # kept for the next call (wait_pending) to raise
                self.error = e
        self.thread = threading.Thread(target=body, name=f"dsrun-ckpt-{self.tag}", daemon=False)
        self.thread.start()
        return self

    def wait(self) -> None:
        """Block until the background save ended; raise its error if it failed."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"the asynchronous save of {self.tag_dir} failed: {error}") from error

    def run(self) -> None:
        rank, world = self.rdv.rank, self.rdv.world
        error, written = None, ""
        try:
            os.makedirs(self.tag_dir, exist_ok=True)
            _fault("before_shard")
            written = self.writer.write().model_dump_json()
            _fault("after_shard")
        except Exception as e:
            error = e
        results = self.rdv.agree("written", error is None, written)
        _raise_unless_all(results, error, f"saving checkpoint {self.tag_dir}")
        error = None
        if rank == 0:
            try:
                fsync_dir(self.tag_dir)
                index = _build_index(self.fields, self.tag, self.tag_dir, world,
                                     [FileEntry.model_validate_json(r) for _, r in results])
                _fault("before_index")
                write_json_atomic(os.path.join(self.tag_dir, INDEX), index.model_dump(mode="json"))
                if self.save_latest:
                    _fault("before_latest")
                    atomic_write(os.path.join(self.save_dir, LATEST), [self.tag.encode()])
                    fsync_dir(self.save_dir)
                if self.keep_last is not None:
                    _prune(self.save_dir, self.keep_last, self.tag)
            except Exception as e:
                error = e
        _raise_unless_all(self.rdv.agree("committed", error is None), error,
                          f"committing checkpoint {self.tag_dir}")
        if rank == 0:
            log.info("saved checkpoint %s (%d rank files)", self.tag_dir, world)


def release_pending(engine) -> None:
    """Before the engine's optimizer step: a running asynchronous save stops
    reading the state the step changes (copying what it has not written)."""
    job = engine._pending_checkpoint
    if job is not None:
        job.release()


def wait_pending(engine) -> None:
    """Wait for the engine's asynchronous save, if one is running; raise its
    error (CheckpointError) if it failed. Called by every save and load."""
    job, engine._pending_checkpoint = engine._pending_checkpoint, None
    if job is not None:
        job.wait()


def _prune(save_dir: str, keep: int, just_saved: str) -> None:
    """Delete the oldest complete tags (by index time) beyond `keep`, never
    the one just saved nor the one `latest` names; incomplete tags stay (a
    save may be running in them, and they are never loaded anyway)."""
    named = None
    if os.path.isfile(os.path.join(save_dir, LATEST)):
        with open(os.path.join(save_dir, LATEST)) as f:
            named = f.read().strip()
    complete = [t for t in tag_names(save_dir) if tag_is_complete(os.path.join(save_dir, t))]
    complete.sort(key=lambda t: index_time(os.path.join(save_dir, t)))
    doomed = [t for t in complete[:max(len(complete) - keep, 0)] if t not in (just_saved, named)]
    for tag in doomed:
        # The index goes first: a crash half-way leaves an incomplete tag, never a broken one.
        os.unlink(os.path.join(save_dir, tag, INDEX))
    if doomed:  # the files go in the background: see [Note: deletion off the save's path]
        discard.discard(save_dir, [os.path.join(save_dir, t) for t in doomed])
        log.info("checkpoint.keep_last=%d: deleted %s", keep, ", ".join(os.path.join(save_dir, t) for t in doomed))


def _index_fields(engine, scheduler, param_groups, exclude_frozen: bool) -> dict:
    """Rank 0: everything of the index that comes from the engine, taken at
    save time (JSON-ready)."""
    loader = engine.training_dataloader.state_dict() if engine.training_dataloader is not None else None
    strategy = engine.strategy
    zero = isinstance(strategy, ZeroStrategy)
    frozen = [n for n, (_, is_frozen) in _global_names(engine).items() if is_frozen]
    return dict(dsrun_version=dsrun.__version__, torch_version=torch.__version__,
                world_size=engine.topology.world_size, stage=engine.config.zero_optimization.stage,
                precision=strategy.precision.name if zero else "fp32",
                config=engine.config.model_dump(mode="json"), param_groups=param_groups,
                scaler=strategy.precision.scaler.state_dict() if zero else None,
                counters={"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                          "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps},
                lr_scheduler=scheduler, dataloader=loader, frozen=frozen,
                excluded_frozen=frozen if exclude_frozen else [])


def _build_index(fields: dict, tag: str, tag_dir: str, world: int, written: list[FileEntry]) -> Index:
    """Rank 0: `fields` plus every shard's header description merged into the
    index; `written`: each rank's file (size and checksum), in rank order."""
    tensors: dict[str, TensorEntry] = {}
    scalars: dict[str, dict] = {}
    rng, client = [], None
    files = {}
    for r in range(world):
        file = shard_name(r, world)
        path = os.path.join(tag_dir, file)
        files[file] = written[r]
        meta = read_shard_metadata(path)
        for gname, e in meta["tensors"].items():
            entry = tensors.setdefault(gname, TensorEntry(shape=e["shape"], dtype=e["dtype"]))
            entry.slices.append(StoredSlice(file=file, key=gname, lo=e["lo"], hi=e["hi"]))
        for name, st in meta["scalars"].items():
            scalars.setdefault(name, {}).update(st)
        rng.append(meta["rng"])
        if r == 0:
            client = meta["client_state"]
    for entry in tensors.values():
        entry.slices.sort(key=lambda s: s.lo)
    return Index(tag=tag, saved_at_ns=time.time_ns(), tensors=tensors, optimizer_scalars=scalars,
                 client_state=client, rng=rng,
                 files=files, **fields)


# ---- load ----------------------------------------------------------------------
def _check_names(engine, index: Index, strict: bool, tag_dir: str) -> set[str]:
    """Missing / unexpected / mismatched-shape module tensors (strict: errors;
    shapes always). Returns the names to load."""
    current = _global_names(engine)
    stored = {n[len("module/"):]: e for n, e in index.tensors.items() if n.startswith("module/")}
    problems = []
    for name, (shape, _) in current.items():
        if name in stored and list(shape) != stored[name].shape:
            problems.append(f"size mismatch for {name}: checkpoint has shape {tuple(stored[name].shape)}, "
                            f"the model {shape}")
    if strict:
        missing = [n for n in current if n not in stored and n not in index.excluded_frozen]
        unexpected = [n for n in stored if n not in current]
        if missing:
            problems.append(f"missing key(s) in checkpoint: {', '.join('module/' + n for n in missing[:10])}"
                            + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
        if unexpected:
            problems.append("unexpected key(s) in checkpoint: "
                            f"{', '.join('module/' + n for n in unexpected[:10])}"
                            + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""))
    if problems:
        raise CheckpointError(f"checkpoint {tag_dir} does not match the model (load_module_strict="
                              f"{strict}): " + "; ".join(problems))
    return {n for n in current if n in stored}


def _load_tensors(engine, index: Index, reader: SliceReader, names: set[str],
                  optimizer_states: bool) -> list[tuple[HeldPiece, torch.Tensor]]:
    """See [Note: resharding on load]. Returns the replicated pieces' tensors
    (the value or an optimizer state, 1-D, hi - lo elements) of which this
    rank read only its part: `_fill_replicated` completes them."""
    optim_keys: dict[str, list[str]] = {}
    for gname in index.tensors:
        if gname.startswith("optim/"):
            name, key = gname[len("optim/"):].rsplit("/", 1)
            optim_keys.setdefault(name, []).append(key)
    requests = []  # read together: each file once, in file order (see [Note: verified reads] in reader.py)
    shared: list[tuple[HeldPiece, torch.Tensor]] = []
    with torch.no_grad():
        for p in held_pieces(engine):
            if p.name not in names:
                continue
            tensors = [(f"module/{p.name}", p.value)]
            if optimizer_states and p.state_key is not None:
                state = engine.optimizer.state[p.state_key]
                for key in optim_keys.get(p.name, ()):
                    if key not in state:  # as the optimizer's first step would create it
                        state[key] = torch.zeros_like(p.state_key, memory_format=torch.contiguous_format)
                    flat = state[key].view(-1)
                    tensors.append((f"optim/{p.name}/{key}", flat[p.state_offset:p.state_offset + p.hi - p.lo]))
                for key, rec in index.optimizer_scalars.get(p.name, {}).items():
                    value = rec["value"]
                    state[key] = value if rec["dtype"] is None else torch.tensor(value, dtype=dtype_of(rec["dtype"]))
            # See [Note: replicated loads]: this rank's part only, the rest comes from the others.
            share = p.replicas is not None
            a, b = (p.write_lo, p.write_hi) if share else (p.lo, p.hi)
            for gname, t in tensors:
                if b > a:
                    requests.append((gname, a, b, t[a - p.lo:b - p.lo]))
                if share:
                    shared.append((p, t))
        reader.read_many(requests)
    return shared


def _fill_replicated(shared: list[tuple[HeldPiece, torch.Tensor]]) -> None:
    """Give every rank the parts of replicated tensors its replicas read (a
    broadcast per part, in the piece's replica group, from the rank that read
    it; collective: every replica lists the same pieces in the same order).
    See [Note: replicated loads]."""
    with torch.no_grad():
        for p, t in shared:
            g = p.replicas
            for q in range(g.size):
                lo, hi = even_part(p.lo, p.hi, q, g.size)
                if hi > lo:
                    src = q if g.group is None else dist.get_global_rank(g.group, q)
                    comm.broadcast(t[lo - p.lo:hi - p.lo], src=src, group=g.group)


def _optimizer_extras(optimizer, rank: int) -> dict[str, torch.Tensor]:
    """Tensors a 1-bit optimizer keeps outside its per-parameter state (see
    [Note: error buffers in checkpoints] in dsrun/runtime/fp16/onebit/base.py):
    "optim_rank/rank<r>/<key>" for this rank's own, "optim_shared/<key>"
    (rank 0 writes them) for those every rank holds alike."""
    if not isinstance(optimizer, CompressedCommOptimizer):
        return {}
    out = {f"optim_rank/rank{rank}/{k}": t for k, t in optimizer.checkpoint_extras().items()}
    if rank == 0:
        out.update({f"optim_shared/{k}": t for k, t in optimizer.replicated_extras().items()})
    return out


def _load_optimizer_extras(engine, index: Index, reader: SliceReader) -> None:
    """Give a 1-bit optimizer its extras back: the shared ones always, this
    rank's own when the world size is the one that saved; rank 0 logs what
    happened to the error-feedback buffers."""
    optimizer, rank = engine.optimizer, engine.topology.rank
    if not isinstance(optimizer, CompressedCommOptimizer):
        return

    def read(prefix: str) -> dict[str, torch.Tensor]:
        return {n[len(prefix):]: reader.read_full(n) for n in index.tensors if n.startswith(prefix)}
    optimizer.load_replicated_extras(read("optim_shared/"))
    own = read(f"optim_rank/rank{rank}/") if index.world_size == engine.topology.world_size else None
    what = optimizer.load_checkpoint_extras(own)
    if rank == 0:
        log.info("%s: %s", type(optimizer).__name__, what)


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict], tag_dir: str) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {tag_dir} has {len(saved)} optimizer param groups, the optimizer "
                              f"{len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, saved):
        for k, v in values.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v


def _read_rng(engine, index: Index, reader: SliceReader) -> dict[str, torch.Tensor] | None:
    """This rank's saved torch RNG states ({"cpu", "cuda"?}), or None when
    the world size changed (the states are per rank)."""
    rank = engine.topology.rank
    if index.world_size != engine.topology.world_size or not index.rng:  # not index.rng: an import
        return None
    out = {"cpu": reader.read_full(f"rng/rank{rank}/torch_cpu")}
    if f"rng/rank{rank}/cuda" in index.tensors and engine.device.type == "cuda":
        out["cuda"] = reader.read_full(f"rng/rank{rank}/cuda")
    return out


def _restore_rng(engine, index: Index, states: dict[str, torch.Tensor] | None) -> None:
    """Every RNG state of this rank (torch CPU and CUDA, Python, NumPy), when
    the world size is the one that saved; else a warning."""
    rank, world = engine.topology.rank, engine.topology.world_size
    if states is None:
        if rank == 0 and not index.rng:
            log.warning("the checkpoint holds no RNG states (imported): RNG states are not restored")
        elif rank == 0:
            log.warning("checkpoint written by %d ranks, loaded on %d: RNG states are not restored",
                        index.world_size, world)
        return
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], engine.device)
    saved = index.rng[rank]
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    if "numpy" in saved:
        try:
            import numpy as np
            name, keys, pos, has_gauss, cached = saved["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass


def load(engine, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         load_module_only: bool = False) -> tuple[str | None, Any]:
    """Load a checkpoint into the engine, on any world size, stage and precision
    (collective: every rank). Returns (tag directory, client_state), or
    (None, None) when load_dir holds no complete checkpoint. load_dir and
    tag are rank 0's when ranks pass different ones (one warning; see
    `agree_on_location`).

    Raises CheckpointError (on every rank) naming the file or key: missing
    tag, incomplete tag, corrupted/truncated file, a checkpoint of another
    model (missing/unexpected keys under load_module_strict, shape mismatch
    always); or naming the ranks, when they passed different load_dir/tag
    under strict checking (then before any file is read). A failure while
    reading may leave some tensors loaded.
    """
    wait_pending(engine)
    topo = engine.topology
    rdv = Rendezvous(engine, "load_checkpoint", tag)
    load_dir, tag = agree_on_location(rdv, engine.config.checkpoint, "load_dir", load_dir,
                                      None if tag is None else str(tag))
    tag, skipped = resolve_tag(load_dir, tag)
    if skipped and topo.rank == 0:
        log.warning("skipped incomplete checkpoint tag(s) in %s (no %s): %s", load_dir, INDEX, ", ".join(skipped))
    if tag is None:
        if topo.rank == 0:
            log.warning("no complete checkpoint in %s; nothing loaded", load_dir)
        return None, None
    tag_dir = os.path.join(load_dir, tag)
    error, index, reader, rng, client_state, shared = None, None, None, None, None, []
    try:
        index = load_index(tag_dir)
        names = _check_names(engine, index, load_module_strict, tag_dir)
        # Each file's checksum is checked by one rank (file i by rank i mod
        # world size) as it reads; the "read" agreement fails every rank.
        reader = SliceReader(tag_dir, index, verify_files=set(sorted(index.files)[topo.rank::topo.world_size]),
                             aio=engine.config.aio)
        optim = load_optimizer_states and not load_module_only
        shared = _load_tensors(engine, index, reader, names, optim)
        if optim:
            _restore_param_groups(engine.optimizer, index.param_groups, tag_dir)
        if not load_module_only:  # read now, so that a bad file fails every rank together
            rng = _read_rng(engine, index, reader)
            client_state = _decode_client(index.client_state, reader) if index.client_state is not None else {}
        if optim:
            _load_optimizer_extras(engine, index, reader)
        reader.verify_rest()
    except Exception as e:
        error = e
    _raise_unless_all(rdv.agree("read", error is None, "" if error is None else str(error)), error,
                      f"loading checkpoint {tag_dir}")
    _fill_replicated(shared)  # collective; every rank read without error
    strategy = engine.strategy
    if isinstance(strategy, ZeroStrategy):
        strategy.after_checkpoint_load()  # collective: masters -> compute copies -> full parameters
    if not load_module_only:
        if isinstance(strategy, ZeroStrategy) and index.scaler is not None and optim:
            scaler = strategy.precision.scaler
            if set(index.scaler) == set(scaler.state_dict()):  # same kind of scaler (fp16 -> fp16)
                scaler.load_state_dict(index.scaler)
        for k, v in index.counters.items():
            setattr(engine, k, int(v))
        if load_lr_scheduler_states and engine.lr_scheduler is not None and index.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(index.lr_scheduler)
        _restore_rng(engine, index, rng)
        if engine.training_dataloader is not None and index.dataloader is not None:
            if index.world_size == topo.world_size:
                engine.training_dataloader.load_state_dict(index.dataloader)
            else:
                if topo.rank == 0:
                    log.warning("checkpoint written by %d ranks, loaded on %d: the data loader starts its "
                                "epoch %d from the beginning (per-rank shards differ)", index.world_size,
                                topo.world_size, index.dataloader["epoch"])
                engine.training_dataloader.load_state_dict({"epoch": index.dataloader["epoch"], "batches": 0})
    if topo.rank == 0:
        log.info("loaded checkpoint %s (written by %d ranks at stage %d, %s)", tag_dir, index.world_size,
                 index.stage, index.precision)
    return tag_dir, {} if load_module_only else client_state


# ---- 16-bit model export ---------------------------------------------------------
_warned_bin = False


def full_16bit_entries(engine, exclude_frozen_parameters: bool = False) -> list[tuple]:
    """What a 16-bit export holds, in state-dict order: (name, tensor, full
    shape, dtype to write, managed by ZeRO) for every parameter (tied ones
    once) and persistent buffer of engine.module. Local; gathers nothing."""
    strategy = engine.strategy
    zero = isinstance(strategy, ZeroStrategy)
    compute = strategy.precision.compute_dtype if zero else None
    entries = []
    for name, p in engine.module.named_parameters():
        if exclude_frozen_parameters and not p.requires_grad:
            continue
        rec = record_of(p) if zero else None
        managed = rec is not None and rec.strategy is strategy
        shape = tuple(rec.shape) if managed else tuple(p.shape)
        entries.append((name, p, shape, compute if managed else p.dtype, managed))
    for mod_name, mod in engine.module.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                name = f"{mod_name}.{bname}" if mod_name else bname
                entries.append((name, buf, tuple(buf.shape), buf.dtype, False))
    return entries


def full_16bit_values(engine, entries: list[tuple]):
    """Yield each entry's full value in its export dtype and shape; a
    collective per ZeRO-managed entry, so every rank must exhaust it."""
    for _, t, shape, dtype, managed in entries:
        full = engine.strategy.full_fp32_param(t) if managed else t.detach()  # collective when managed
        yield full.to(dtype).reshape(shape)


def save_16bit(engine, save_dir: str, save_filename: str = "model.safetensors",
               exclude_frozen_parameters: bool = False) -> str:
    """Write the module's full state dict in the compute dtype (parameters;
    persistent buffers in their own dtype) as ONE safetensors file from
    rank 0 (collective: every rank).

    Parameters are gathered one at a time (an all-reduce of the fp32 master
    pieces at stages 1-3) and streamed into the file, so rank 0 holds one
    full parameter at a time, not the model. Tied parameters appear once,
    under their first name. A DeepSpeed-style "*.bin" name is replaced by
    its safetensors equivalent ("pytorch_model.bin" -> "model.safetensors"),
    with a warning. Returns the file's path. Raises CheckpointError on every
    rank when rank 0 cannot write.
    """
    global _warned_bin
    wait_pending(engine)
    if save_filename.endswith(".bin"):
        new = ("model.safetensors" if save_filename == "pytorch_model.bin"
               else save_filename[:-len(".bin")] + ".safetensors")
        if not _warned_bin and engine.topology.rank == 0:
            log.warning("save_16bit_model writes safetensors, never pickles: %s becomes %s", save_filename, new)
        _warned_bin = True
        save_filename = new
    rdv = Rendezvous(engine, "save_16bit_model", save_filename)
    entries = full_16bit_entries(engine, exclude_frozen_parameters)
    path = os.path.join(save_dir, save_filename)
    gen, error = full_16bit_values(engine, entries), None
    if engine.topology.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            specs = [(name, shape, dtype) for name, _, shape, dtype, _ in entries]
            atomic_write(path, stream_safetensors(specs, gen, {"format": "pt"}))
            fsync_dir(save_dir)
        except Exception as e:
            error = e
    for _ in gen:  # the other ranks (and rank 0 after a failure) still join every gather
        pass
    _raise_unless_all(rdv.agree("written", error is None), error, f"saving the 16-bit model to {path}")
    return path

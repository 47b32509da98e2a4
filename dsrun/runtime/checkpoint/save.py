"""Writing a checkpoint: each rank's shard, then rank 0's commit (see [Note: commit protocol] in store.py)."""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from typing import Any, Callable

import torch

import dsrun
from dsrun.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
from dsrun.runtime.checkpoint import discard, node_local
from dsrun.runtime.checkpoint.parts import (held_pieces, model_names, optimizer_extras, written_by_model_rank_zero,
                                            written_elsewhere)
from dsrun.runtime.checkpoint.pieces import HeldPiece
from dsrun.runtime.checkpoint.rendezvous import Rendezvous, raise_unless_all
from dsrun.runtime.checkpoint.store import (INDEX, LATEST, CheckpointError, FileEntry, Index, NodeRecord,
                                            StoredSlice, TensorEntry, atomic_write, dtype_name, fsync_dir,
                                            index_time, is_shard_file, read_shard_metadata, shard_name,
                                            tag_is_complete, tag_names)
from dsrun.runtime.distributed.nodes import NodeMap
from dsrun.runtime.checkpoint.tensor_split import Assembled, assemble_split_tensors, contributes
from dsrun.runtime.checkpoint.writer import ShardWriter, StagingBuffer
from dsrun.runtime.parallel.tensor.split import split_of
from dsrun.runtime.engine.train_state import TrainingParts

log = logging.getLogger("dsrun.checkpoint")


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


def prepare_save(parts: TrainingParts, rdv: Rendezvous, save_dir: str, tag: str, client_state: dict,
                 save_latest: bool, exclude_frozen_parameters: bool, lr_scheduler: Any, dataloader: Any,
                 fault: Callable[[str], None]) -> "SaveJob":
    """Everything of one save that must happen on the calling thread: the old
    index of an overwritten tag removed (rank 0), this rank's tensors and
    description gathered, and the ranks' agreement that each succeeded.
    Returns the job that writes and commits (run it, or start it in the
    background; see [Note: copy-on-write snapshot] in writer.py).

    With `checkpoint.use_node_local_storage` each node's local rank 0
    prepares its node's tag directory (see [Note: node-local checkpoints]
    in node_local.py).

    Raises CheckpointError (on every rank) when the tag is invalid, a rank
    failed to prepare, or state is not JSON-able (LR scheduler, client_state);
    a tag directory this call created is then removed again.
    """
    if not tag or "/" in tag or tag in (".", "..", LATEST):
        raise CheckpointError(f"invalid checkpoint tag {tag!r}")
    rank = parts.topology.rank
    tag_dir = os.path.join(save_dir, tag)
    error, tensors, meta, stepped, fields = None, {}, {}, set(), None
    nodes, keeper = None, rank == 0  # keeper: prepares the tag directory, writes the index and `latest`
    created = False  # the keeper made the tag directory (a failed save removes it again)
    names = model_names(parts)  # collective over a split model's parts: before anything may raise
    assembled = _assembled_splits(parts, exclude_frozen_parameters)  # collective too (tensor parallelism)
    try:
        if parts.config.checkpoint.use_node_local_storage:
            nodes = node_local.node_map(parts.topology)
            keeper = node_local.is_node_leader(nodes, rank)
        if keeper:
            created = not os.path.isdir(tag_dir)
            os.makedirs(tag_dir, exist_ok=True)
            if os.path.exists(os.path.join(tag_dir, INDEX)):
                os.unlink(os.path.join(tag_dir, INDEX))  # overwriting: incomplete first, never mixed
                fsync_dir(tag_dir)
            old = [os.path.join(tag_dir, f) for f in os.listdir(tag_dir) if is_shard_file(f)]
            if old:  # any world size's; deleted in the background (see discard.py)
                discard.discard(save_dir, old)
        scheduler = None
        if lr_scheduler is not None:
            scheduler = _json_checked(lr_scheduler.state_dict(), "the LR scheduler's state_dict")
        param_groups = _json_checked([{k: v for k, v in g.items() if k != "params"}
                                      for g in parts.optimizer.param_groups], "optimizer param_groups")
        elsewhere = written_elsewhere(parts)  # tied copies: see [Note: a model split across ranks] in parts.py
        pieces = [p for p in held_pieces(parts) if p.name not in elsewhere]
        tensors, meta, stepped = rank_payload(parts, pieces, client_state, exclude_frozen_parameters, assembled)
        if rank == 0:
            fields = _index_fields(parts, names, scheduler, param_groups, dataloader, exclude_frozen_parameters)
    except Exception as e:  # reported to every rank, then raised here
        error = e
    try:
        raise_unless_all(rdv.agree("prepared", error is None), error, f"preparing checkpoint {tag_dir}")
    except BaseException:
        if created:  # nothing was written into it yet
            try:
                _remove_dir(tag_dir)
            except OSError as e:
                log.warning("after the failed save of %s, removing its directory failed: %s", tag_dir, e)
        raise
    background = parts.config.checkpoint.async_save
    writer = ShardWriter(os.path.join(tag_dir, shard_name(rank, parts.topology.world_size)), tensors,
                         {"dsrun": json.dumps(meta)}, stepped if background else set(tensors), parts.config.aio)
    return SaveJob(rdv, save_dir, tag, writer, fields, save_latest, parts.config.checkpoint.keep_last, fault,
                   keeper, nodes, json.dumps(meta) if nodes is not None else None, created)


def _assembled_splits(parts: TrainingParts, exclude_frozen: bool) -> Assembled | None:
    """The tensor-parallel parameters' full tensors, this rank's even part
    of each (collective over the job; see [Note: tensor-parallel
    checkpoints] in tensor_split.py); None when the mesh has no model axis."""
    mesh = parts.mesh
    if mesh.size("model") == 1:
        return None
    elsewhere = written_elsewhere(parts)
    order = [(name, split, contributes(p)) for name, p in parts.module.named_parameters()
             if (split := split_of(p)) is not None and name not in elsewhere
             and not (exclude_frozen and not p.requires_grad)]
    pieces = [p for p in held_pieces(parts) if p.split is not None]
    return assemble_split_tensors(parts.optimizer, pieces, order, mesh, parts.topology.device)


def rank_payload(parts: TrainingParts, pieces: list[HeldPiece], client_state, exclude_frozen: bool,
                 assembled: Assembled | None = None):
    """This rank's tensors (key -> 1-D tensor), its description (JSON) and
    the keys of the tensors only an optimizer step changes (trainable values
    and their optimizer states: see [Note: copy-on-write snapshot] in writer.py).

    Under tensor parallelism, `assembled` holds what this rank writes of the
    tensor-parallel parameters (pieces with a `split` are skipped here), and
    only model rank 0 writes the tensors every model rank holds alike."""
    rank, device = parts.topology.rank, parts.topology.device
    replicated = written_by_model_rank_zero(parts)
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
        if p.split is not None or not replicated:
            continue
        a, b = p.write_lo - p.lo, p.write_hi - p.lo
        put(f"module/{p.name}", p.shape, p.value[a:b], p.write_lo, p.write_hi, p.trainable)
        if p.state_key is None:
            continue
        for k, v in parts.optimizer.state.get(p.state_key, {}).items():
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
    if assembled is not None:
        for gname, shape, t, lo, hi in assembled.tensors:
            put(gname, shape, t, lo, hi)
        for name, states in assembled.scalars.items():
            scalars.setdefault(name, {}).update(states)
    for gname, t in optimizer_extras(parts).items():
        put(gname, [t.numel()], t.reshape(-1), 0, t.numel(), True)
    rng_key = f"rng/rank{rank}/torch_cpu"
    put(rng_key, [torch.get_rng_state().numel()], torch.get_rng_state(), 0, torch.get_rng_state().numel())
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
        put(f"rng/rank{rank}/cuda", [state.numel()], state, 0, state.numel())
    for name, state in get_cuda_rng_tracker().get_states().items():  # tensor-parallel regions' states
        put(f"rng/rank{rank}/tracker/{name}", [state.numel()], state, 0, state.numel())
    client = None
    if rank == 0:
        client_tensors: dict[str, torch.Tensor] = {}
        client = _encode_client(client_state, "", client_tensors)
        for key, t in client_tensors.items():
            put(key, [t.numel()], t, 0, t.numel())
    meta = {"rank": rank, "tensors": entries, "scalars": scalars, "rng": _python_rng(), "client_state": client}
    return tensors, meta, stepped


class SaveJob:
    """Write one rank's shard and commit the tag (see [Note: commit protocol]);
    holds no reference to the engine, so it can run in a background thread.

    keeper: this rank writes the index and `latest` (rank 0; with node-local
    storage, each node's local rank 0). nodes: the job's nodes with
    node-local storage, else None; meta: then this rank's description (the
    shard header's JSON), sent to rank 0 (see [Note: node-local checkpoints]
    in node_local.py). created: the keeper made the tag directory for this
    save (see [Note: a failed save leaves no files])."""

    def __init__(self, rdv: Rendezvous, save_dir: str, tag: str, writer: ShardWriter, fields: dict | None,
                 save_latest: bool, keep_last: int | None, fault: Callable[[str], None], keeper: bool,
                 nodes: NodeMap | None = None, meta: str | None = None, created: bool = False):
        self.rdv, self.save_dir, self.tag = rdv, save_dir, tag
        self.keeper, self.nodes, self.meta, self.created = keeper, nodes, meta, created
        self._together = False  # every rank returned from the last agreement (see _agree)
        self._named = False  # `latest` names this tag: a later failure must not remove it
        self.tag_dir = os.path.join(save_dir, tag)
        self.writer, self.fields, self.fault = writer, fields, fault
        self.staging: StagingBuffer | None = None
        self.save_latest, self.keep_last = save_latest, keep_last
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.release_s = 0.0  # time the training thread spent in release()

    def snapshot(self, staging: StagingBuffer) -> None:
        """Copy what may change before the write reads it into `staging`
        (kept for `release`); see [Note: copy-on-write snapshot]."""
        self.staging = staging
        self.writer.snapshot(staging)

    def release(self) -> None:
        """Called before an optimizer step: see [Note: copy-on-write snapshot]."""
        t = time.perf_counter()
        self.writer.release(self.staging)
        self.release_s += time.perf_counter() - t

    def start(self) -> "SaveJob":
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
        """Write this rank's shard and commit the tag (collective over the
        rendezvous). Raises CheckpointError or the OSError of this rank's
        write (naming the file) when any rank failed, on every rank; the
        tag's files are then removed: see [Note: a failed save leaves no
        files]. A failure to prune old tags (checkpoint.keep_last) after
        the commit raises too but leaves the new tag in place."""
        try:
            self._write_and_commit()
        except BaseException:
            if not self._named:
                self._abandon()
            raise
        if self.keep_last is not None:
            error = None
            if self.keeper:
                try:
                    _prune(self.save_dir, self.keep_last, self.tag)
                except Exception as e:
                    error = e
            raise_unless_all(self.rdv.agree("pruned", error is None), error,
                             f"deleting old checkpoints beside {self.tag_dir} (checkpoint.keep_last)")
        if self.rdv.rank == 0:
            log.info("saved checkpoint %s (%d rank files%s)", self.tag_dir, self.rdv.world,
                     "" if self.nodes is None else f", node-local on {self.nodes.num_nodes} node(s)")

    def _agree(self, step: str, error: BaseException | None, report: str = "") -> list[tuple[bool, str]]:
        """`rdv.agree`, noting whether every rank got there (a timeout, when
        a rank died or hangs, raises with `_together` False)."""
        self._together = False
        results = self.rdv.agree(step, error is None, report)
        self._together = True
        return results

    def _abandon(self) -> None:
        """After a failed save: remove this rank's files of the tag, and with
        every rank here the keeper's index and the directory it created.
        Errors are logged, never raised over the save's own error.

        [Note: a failed save leaves no files]
        A rank whose shard landed before another rank failed (a disk that
        filled up under the other) would leave a half checkpoint behind that
        `load_checkpoint(tag=...)`, a listing of tags or the next save meets.
        So on any failure every rank deletes its own shard; the keeper first
        deletes the index if it wrote one (a failure at `latest`: the tag
        turns incomplete before any shard goes, and `latest` still names
        the previous tag; once `latest` names the new tag, the save is
        committed and nothing is removed), and, once every rank reports its shard gone,
        removes the tag directory if this save created it; every rank raises
        only after that, so a rank that lists the directory after its error
        finds nothing of the failed tag. When a rank did
        not report (dead or hung) the others delete only their own files and
        leave the directory: the silent rank may still be writing into it.
        """
        together = self._together

        def attempt(remove: Callable[[str], None], path: str) -> None:
            try:
                remove(path)
            except OSError as e:  # the save's own error is what the caller gets
                log.warning("after the failed save of %s, removing %s failed: %s", self.tag_dir, path, e)
        if self.keeper:
            attempt(_remove_file, os.path.join(self.tag_dir, INDEX))
        try:
            if together:
                self.rdv.agree("unindexed", True)
            attempt(_remove_file, self.writer.path)
            if together:
                self.rdv.agree("abandoned", True)
                if self.keeper and self.created:
                    attempt(_remove_dir, self.tag_dir)
                self.rdv.agree("cleaned", True)  # no rank raises while the directory is still there
        except CheckpointError as e:  # a rank stopped answering while cleaning up
            log.warning("after the failed save of %s: %s", self.tag_dir, e)

    def _write_and_commit(self) -> None:
        rank = self.rdv.rank
        error, written = None, ""
        try:
            os.makedirs(self.tag_dir, exist_ok=True)
            self.fault("before_shard")
            written = self.writer.write().model_dump_json()
            if self.nodes is not None:
                written = json.dumps({"file": json.loads(written), "meta": self.meta, "host": node_local.host()})
            self.fault("after_shard")
        except Exception as e:
            error = e
        results = self._agree("written", error, written)
        raise_unless_all(results, error, f"saving checkpoint {self.tag_dir}")
        error, index = None, b""
        if rank == 0:
            try:
                index = self._index([r for _, r in results])
            except Exception as e:
                error = e
        if self.nodes is not None:  # every node's keeper writes rank 0's index
            shared = self._agree("index", error, index.decode())
            raise_unless_all(shared, error, f"building the index of checkpoint {self.tag_dir}")
            index = shared[0][1].encode()
        named = ""  # "latest" once `latest` names this tag (the save is then committed)
        if self.keeper and error is None:
            try:
                fsync_dir(self.tag_dir)
                self.fault("before_index")
                atomic_write(os.path.join(self.tag_dir, INDEX), [index])
                fsync_dir(self.tag_dir)
                if self.save_latest:
                    self.fault("before_latest")
                    atomic_write(os.path.join(self.save_dir, LATEST), [self.tag.encode()])
                    named = LATEST
                    fsync_dir(self.save_dir)
            except Exception as e:
                error = e
        results = self._agree("committed", error, named)
        self._named = any(report == LATEST for _, report in results)
        raise_unless_all(results, error, f"committing checkpoint {self.tag_dir}")

    def _index(self, reports: list[str]) -> bytes:
        """Rank 0: the index's bytes from every rank's "written" report."""
        world = self.rdv.world
        if self.nodes is None:
            return _index_bytes(_build_index(self.fields, self.tag, self.tag_dir, world,
                                             [FileEntry.model_validate_json(r) for r in reports]))
        records = [json.loads(r) for r in reports]
        nodes = [NodeRecord(host=records[ranks[0]]["host"], ranks=list(ranks)) for ranks in self.nodes.nodes]
        written_on = {shard_name(r, world): self.nodes.node_of(r) for r in range(world)}
        index = _build_index(self.fields, self.tag, self.tag_dir, world,
                             [FileEntry.model_validate(rec["file"]) for rec in records],
                             [json.loads(rec["meta"]) for rec in records])
        return _index_bytes(index.model_copy(update={"nodes": nodes, "written_on": written_on}))


def _remove_file(path: str) -> None:
    """Unlink `path` if it exists and fsync its directory."""
    if os.path.exists(path):
        os.unlink(path)
        fsync_dir(os.path.dirname(path))


def _remove_dir(path: str) -> None:
    """Remove the directory `path`, which must be empty (OSError naming
    what it still holds otherwise: files that are not this save's)."""
    try:
        os.rmdir(path)
    except OSError as e:
        left = sorted(os.listdir(path)) if os.path.isdir(path) else []
        raise OSError(e.errno, f"{e.strerror}; it holds {', '.join(left)}" if left else e.strerror, path) from e
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _index_bytes(index: Index) -> bytes:
    # no indent: json then uses its C encoder (an index lists every tensor slice)
    return json.dumps(index.model_dump(mode="json"), separators=(",", ":")).encode()


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


def _index_fields(parts: TrainingParts, names: dict, scheduler, param_groups, dataloader,
                  exclude_frozen: bool) -> dict:
    """Rank 0: everything of the index that comes from the training parts,
    taken at save time (JSON-ready); `names`: `model_names(parts)`."""
    loader = dataloader.state_dict() if dataloader is not None else None
    strategy = parts.strategy
    frozen = [n for n, (_, is_frozen) in names.items() if is_frozen]
    return dict(dsrun_version=dsrun.__version__, torch_version=torch.__version__,
                world_size=parts.topology.world_size,
                pipeline_stages=parts.split.parts if parts.split is not None else 1,
                tensor_parallel=parts.mesh.size("model"), sequence_parallel=parts.mesh.size("sequence"),
                stage=parts.config.zero_optimization.stage,
                precision=strategy.precision_name(), config=parts.config.model_dump(mode="json"),
                param_groups=param_groups, scaler=strategy.scaler_state(), counters=parts.state.state_dict(),
                lr_scheduler=scheduler, dataloader=loader, frozen=frozen,
                states={name: _json_checked(obj.state_dict(), f"the state_dict of {name}")
                        for name, obj in parts.stateful.items()},
                excluded_frozen=frozen if exclude_frozen else [])


def _build_index(fields: dict, tag: str, tag_dir: str, world: int, written: list[FileEntry],
                 metas: list[dict] | None = None) -> Index:
    """Rank 0: `fields` plus every shard's header description merged into the
    index; `written`: each rank's file (size and checksum), in rank order;
    `metas`: each rank's description (None: read from the shards' headers)."""
    tensors: dict[str, TensorEntry] = {}
    scalars: dict[str, dict] = {}
    rng, client = [], None
    files = {}
    for r in range(world):
        file = shard_name(r, world)
        path = os.path.join(tag_dir, file)
        files[file] = written[r]
        meta = read_shard_metadata(path) if metas is None else metas[r]
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

"""Reading a checkpoint into the training parts, on any world size, stage and precision.

See [Note: resharding on load] and [Note: replicated loads] in checkpointer.py.
"""
from __future__ import annotations

import logging
import os
import random
from typing import Any

import torch
import torch.distributed as dist

from dsrun.runtime import comm
from dsrun.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
from dsrun.runtime.checkpoint import node_local
from dsrun.runtime.checkpoint.parts import held_pieces, model_names
from dsrun.runtime.checkpoint.pieces import HeldPiece, even_part
from dsrun.runtime.checkpoint.reader import SliceReader
from dsrun.runtime.checkpoint.rendezvous import Rendezvous, raise_unless_all
from dsrun.runtime.checkpoint.tensor_split import SplitRead, split_read
from dsrun.runtime.checkpoint.store import INDEX, CheckpointError, Index, dtype_of, load_index, resolve_tag
from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer
from dsrun.runtime.engine.train_state import TrainingParts

log = logging.getLogger("dsrun.checkpoint")


def _decode_client(value: Any, reader: SliceReader) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return reader.read_full(value["__tensor__"]).view(value["shape"])
        return {k: _decode_client(v, reader) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_client(v, reader) for v in value]
    return value


def _check_names(current: dict, index: Index, strict: bool, tag_dir: str) -> set[str]:
    """Missing / unexpected / mismatched-shape module tensors of the model
    (`current`: `model_names`, the whole model's name -> (shape, frozen))
    (strict: errors; shapes always). Returns the names to load."""
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


def _tensor_reads(parts: TrainingParts, index: Index, names: set[str], optimizer_states: bool
                  ) -> tuple[list[tuple[str, int, int, torch.Tensor]], list[tuple[HeldPiece, torch.Tensor]],
                             list[SplitRead]]:
    """See [Note: resharding on load]. Returns the reads this rank makes
    (global name, lo, hi, destination: `SliceReader.read_many`'s requests),
    the replicated pieces' tensors (the value or an optimizer state,
    1-D, hi - lo elements) of which it reads only its part:
    `_fill_replicated` completes them, and the reads of tensor-parallel
    slices, to `finish` after the reads (see [Note: tensor-parallel
    checkpoints] in tensor_split.py)."""
    optim_keys: dict[str, list[str]] = {}
    for gname in index.tensors:
        if gname.startswith("optim/"):
            name, key = gname[len("optim/"):].rsplit("/", 1)
            optim_keys.setdefault(name, []).append(key)
    requests = []  # read together: each file once, in file order (see [Note: verified reads] in reader.py)
    shared: list[tuple[HeldPiece, torch.Tensor]] = []
    picks: list[SplitRead] = []
    with torch.no_grad():
        for p in held_pieces(parts):
            if p.name not in names:
                continue
            tensors = [(f"module/{p.name}", p.value)]
            if optimizer_states and p.state_key is not None:
                state = parts.optimizer.state[p.state_key]
                for key in optim_keys.get(p.name, ()):
                    if key not in state:  # as the optimizer's first step would create it
                        state[key] = torch.zeros_like(p.state_key, memory_format=torch.contiguous_format)
                    flat = state[key].view(-1)
                    tensors.append((f"optim/{p.name}/{key}", flat[p.state_offset:p.state_offset + p.hi - p.lo]))
                for key, rec in index.optimizer_scalars.get(p.name, {}).items():
                    value = rec["value"]
                    state[key] = value if rec["dtype"] is None else torch.tensor(value, dtype=dtype_of(rec["dtype"]))
            if p.split is not None:  # its elements are spread over the stored full tensor
                for gname, t in tensors:
                    pick = split_read(p, p.split, t)
                    if pick is not None:
                        requests.append((gname, pick.first, pick.last, pick.scratch))
                        picks.append(pick)
                continue
            # See [Note: replicated loads]: this rank's part only, the rest comes from the others.
            share = p.replicas is not None
            a, b = (p.write_lo, p.write_hi) if share else (p.lo, p.hi)
            for gname, t in tensors:
                if b > a:
                    requests.append((gname, a, b, t[a - p.lo:b - p.lo]))
                if share:
                    shared.append((p, t))
    return requests, shared, picks


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


def _load_optimizer_extras(parts: TrainingParts, index: Index, reader: SliceReader) -> None:
    """Give a 1-bit optimizer its extras back: the shared ones always, this
    rank's own when the world size is the one that saved; rank 0 logs what
    happened to the error-feedback buffers."""
    optimizer, rank = parts.optimizer, parts.topology.rank
    if not isinstance(optimizer, CompressedCommOptimizer):
        return

    def read(prefix: str) -> dict[str, torch.Tensor]:
        return {n[len(prefix):]: reader.read_full(n) for n in index.tensors if n.startswith(prefix)}
    optimizer.load_replicated_extras(read("optim_shared/"))
    own = read(f"optim_rank/rank{rank}/") if index.world_size == parts.topology.world_size else None
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


def _realign_micro_steps(parts: TrainingParts, index: Index) -> None:
    """Put the loaded micro-step count on the current gradient accumulation window.

    The engine decides the accumulation boundary from micro_steps modulo
    gradient_accumulation_steps. A checkpoint loaded with another number
    of accumulation steps (a restart on a smaller world with
    train_batch_size fixed: 4 ranks x 2 micro-batches -> 2 ranks x 4)
    would put the boundary in the middle of a window and step the
    optimizer on part of a batch; so micro_steps becomes the windows done
    times the current count. Gradients of a partly accumulated window are
    not saved, so a checkpoint taken inside one resumes at the start of
    the next window (rank 0 warns).
    """
    old = int(index.config.get("gradient_accumulation_steps") or 0)
    new = parts.config.gradient_accumulation_steps
    done = parts.state.micro_steps
    if old < 1 or old == new:
        return
    parts.state.micro_steps = done // old * new
    if done % old and parts.topology.rank == 0:
        log.warning("checkpoint taken after micro-step %d of a %d-step accumulation window; resuming at the "
                    "start of the next window of %d (partial gradients are not saved)", done % old, old, new)


def _same_layout(parts: TrainingParts, index: Index) -> bool:
    """Whether the checkpoint was written by as many ranks, split into as
    many pipeline stages, tensor-parallel and sequence-parallel ranks: then
    every rank has the saving rank's place in the mesh, and the per-rank
    states (RNG, data position) belong to it."""
    stages = parts.split.parts if parts.split is not None else 1
    return (index.world_size == parts.topology.world_size and index.pipeline_stages == stages
            and index.tensor_parallel == parts.mesh.size("model")
            and index.sequence_parallel == parts.mesh.size("sequence"))


def _restore_loader(parts: TrainingParts, index: Index, dataloader: Any) -> None:
    """Put the data loader at the saved position: the same layout's per-rank
    one, or in another layout the saved global sample (a loader that saved
    `samples`: see [Note: resuming mid-epoch] in
    dsrun/runtime/engine/dataloader.py); else, or when that sample is not a
    whole global micro-batch here, the saved epoch's start, with a warning."""
    state, topo = index.dataloader, parts.topology
    if _same_layout(parts, index) or "samples" in state:
        try:
            dataloader.load_state_dict(state)
            return
        except ValueError as e:
            reason = str(e)
    else:
        reason = "per-rank shards differ"
    if topo.rank == 0:
        log.warning("checkpoint written by %d ranks (%d pipeline stages), loaded on %d in another layout: the "
                    "data loader starts its epoch %d from the beginning (%s)", index.world_size,
                    index.pipeline_stages, topo.world_size, state["epoch"], reason)
    dataloader.load_state_dict({"epoch": state["epoch"], "batches": 0})


def _full_reads(parts: TrainingParts, index: Index, optim: bool, module_only: bool) -> list[str]:
    """The names this rank reads whole: its RNG states (same layout only,
    see `_read_rng`), client_state's tensors, a 1-bit optimizer's buffers
    (see `_load_optimizer_extras`)."""
    rank = parts.topology.rank
    names = []
    if not module_only:
        if _same_layout(parts, index) and index.rng:
            names += list(_rng_keys(parts.topology, index).values())
        names += node_local.client_keys(index.client_state)
    if optim and isinstance(parts.optimizer, CompressedCommOptimizer):
        own = f"optim_rank/rank{rank}/" if index.world_size == parts.topology.world_size else None
        names += [n for n in index.tensors if n.startswith("optim_shared/") or (own and n.startswith(own))]
    return names


def _rng_keys(topology: Topology, index: Index) -> dict[str, str]:
    """This rank's stored torch RNG states it can restore -> their keys:
    "cpu"; "cuda" on a CUDA device; "tracker/<name>" (the tensor-parallel
    RNG tracker's states, see dsrun/runtime/parallel/tensor/random.py) when
    saved on the same kind of device (they are that device's generator's)."""
    prefix = f"rng/rank{topology.rank}/"
    on_cuda = topology.device.type == "cuda"
    out = {"cpu": f"{prefix}torch_cpu"}
    if f"{prefix}cuda" in index.tensors and on_cuda:
        out["cuda"] = f"{prefix}cuda"
    if (f"{prefix}cuda" in index.tensors) == on_cuda:
        out.update({key[len(prefix):]: key for key in index.tensors if key.startswith(f"{prefix}tracker/")})
    return out


def _read_rng(topology: Topology, index: Index, reader: SliceReader,
              same_layout: bool) -> dict[str, torch.Tensor] | None:
    """This rank's saved torch RNG states (see `_rng_keys`), or None when
    the layout changed (the states are per rank)."""
    if not same_layout or not index.rng:  # not index.rng: an import
        return None
    return {what: reader.read_full(key) for what, key in _rng_keys(topology, index).items()}


def _restore_rng(topology: Topology, index: Index, states: dict[str, torch.Tensor] | None) -> None:
    """Every RNG state of this rank (torch CPU and CUDA, the tensor-parallel
    tracker's, Python, NumPy), when the layout is the one that saved
    (`_same_layout`); else a warning. See "RNG states" in docs/checkpoints.md."""
    rank, world = topology.rank, topology.world_size
    if states is None:
        if rank == 0 and not index.rng:
            log.warning("the checkpoint holds no RNG states (imported): RNG states are not restored")
        elif rank == 0:
            log.warning("checkpoint written by %d ranks (%d pipeline stages), loaded on %d in another layout: "
                        "RNG states are not restored", index.world_size, index.pipeline_stages, world)
        return
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], topology.device)
    tracker = {what[len("tracker/"):]: state for what, state in states.items() if what.startswith("tracker/")}
    if tracker:  # names the script added and the checkpoint lacks keep their states
        get_cuda_rng_tracker().set_states({**get_cuda_rng_tracker().get_states(), **tracker})
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


def load(parts: TrainingParts, rdv: Rendezvous, load_dir: str, tag: str | None, load_module_strict: bool,
         load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool,
         lr_scheduler: Any, dataloader: Any) -> tuple[str | None, Any]:
    """Load the checkpoint load_dir/<tag> (tag None: the latest complete one)
    into `parts` and the given lr_scheduler and dataloader (None: skipped),
    on any world size, stage and precision (collective: every rank, after
    `rdv` was made and the ranks agreed on load_dir and tag, see
    `Checkpointer.load`). Returns (tag directory, client_state), or
    (None, None) when load_dir holds no complete checkpoint.

    With `checkpoint.use_node_local_storage` load_dir is each node's own
    directory: the ranks agree on the tag, and check that each finds the
    files it needs there before any reads (see [Note: node-local
    checkpoints] in node_local.py).

    Raises CheckpointError (on every rank) naming the file or key: missing
    tag, incomplete tag, corrupted/truncated file, a checkpoint of another
    model (missing/unexpected keys under load_module_strict, shape mismatch
    always), with node-local storage a file missing from the node that
    needs it (then before anything is read). A failure while reading may
    leave some tensors loaded.
    """
    topo = parts.topology
    nodes = node_local.node_map(topo) if parts.config.checkpoint.use_node_local_storage else None
    if nodes is None:
        tag, skipped = resolve_tag(load_dir, tag)
    else:
        tag, skipped = node_local.agree_on_tag(rdv, load_dir, tag)
    if skipped and topo.rank == 0:
        log.warning("skipped incomplete checkpoint tag(s) in %s (no %s): %s", load_dir, INDEX, ", ".join(skipped))
    if tag is None:
        if topo.rank == 0:
            log.warning("no complete checkpoint in %s; nothing loaded", load_dir)
        return None, None
    tag_dir = os.path.join(load_dir, tag)
    error, index, reader, rng, client_state, shared = None, None, None, None, None, []
    current = model_names(parts)  # collective over a split model's parts: before anything may raise
    optim = load_optimizer_states and not load_module_only
    try:
        index = load_index(tag_dir)
        names = _check_names(current, index, load_module_strict, tag_dir)
        requests, shared, picks = _tensor_reads(parts, index, names, optim)
        # Each file's checksum is checked by one rank (file i by rank i mod
        # world size) as it reads; the "read" agreement fails every rank.
        verify = set(sorted(index.files)[topo.rank::topo.world_size])
        if nodes is not None:  # each rank checks what it reads, from its node's directory
            verify = set(node_local.files_needed(index, [r[:3] for r in requests],
                                                 _full_reads(parts, index, optim, load_module_only)))
    except Exception as e:
        error = e
    if nodes is not None:  # before any byte is read; raises on every rank
        node_local.check_local(rdv, tag_dir, index, sorted(verify) if error is None else [], error, nodes)
    try:
        if error is not None:
            raise error
        reader = SliceReader(tag_dir, index, verify_files=verify, aio=parts.config.aio)
        reader.read_many(requests)
        for pick in picks:
            pick.finish()
        if optim:
            _restore_param_groups(parts.optimizer, index.param_groups, tag_dir)
        if not load_module_only:  # read now, so that a bad file fails every rank together
            rng = _read_rng(topo, index, reader, _same_layout(parts, index))
            client_state = _decode_client(index.client_state, reader) if index.client_state is not None else {}
        if optim:
            _load_optimizer_extras(parts, index, reader)
        reader.verify_rest()
    except Exception as e:
        error = e
    raise_unless_all(rdv.agree("read", error is None, "" if error is None else str(error)), error,
                      f"loading checkpoint {tag_dir}")
    _fill_replicated(shared)  # collective; every rank read without error
    parts.strategy.after_checkpoint_load()  # collective (ZeRO: masters -> compute copies -> full parameters)
    if not load_module_only:
        if index.scaler is not None and optim:
            parts.strategy.load_scaler_state(index.scaler)
        parts.state.load_state_dict(index.counters)
        _realign_micro_steps(parts, index)
        if load_lr_scheduler_states and lr_scheduler is not None and index.lr_scheduler is not None:
            lr_scheduler.load_state_dict(index.lr_scheduler)
        for name, obj in parts.stateful.items():
            if name in index.states:
                obj.load_state_dict(index.states[name])
            elif topo.rank == 0:
                log.warning("checkpoint %s holds no state of %s; it starts from its beginning", tag_dir, name)
        _restore_rng(topo, index, rng)
        if dataloader is not None and index.dataloader is not None:
            _restore_loader(parts, index, dataloader)
    if topo.rank == 0:
        log.info("loaded checkpoint %s (written by %d ranks at stage %d, %s)", tag_dir, index.world_size,
                 index.stage, index.precision)
    return tag_dir, {} if load_module_only else client_state

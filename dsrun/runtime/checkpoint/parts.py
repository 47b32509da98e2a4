"""What a checkpoint asks of the training parts: the pieces this rank holds,
every tensor's global name and shape, a 1-bit optimizer's extra buffers.

The strategy says what it holds (`GradientStrategy.checkpoint_pieces`,
`managed_params`, ...); everything else is saved whole. A new kind of
parallelism plugs in by implementing those methods, with no type test here.

[Note: a model split across ranks]
When each rank holds one part of the model (`TrainingParts.split`: a
pipeline stage), nothing of the format changes: parameter names are global
("{layer}.{param}", "tied_modules.{key}.{param}"), each rank writes the
pieces of its part and rank 0's index lists every file's tensors. Three
things differ. The tensors every rank holds whole are held alike only by
the part's replicas (`split.replicas`), which split their writing and
share their reads. A weight tied across parts is written by the lowest
part holding it only (`split.duplicates` names the other copies), and read
into every copy by name. And the names of the whole model, which the
index's frozen list and a strict load's missing/unexpected check need, are
the union over the parts (`model_names`, a collective over
`split.parts_group`). A load then reads each piece by name from whatever
files hold it, so any split (or none) loads any other.
"""
from __future__ import annotations

import torch

from dsrun.runtime import comm
from dsrun.runtime.checkpoint.pieces import HeldPiece, plain_pieces
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer
from dsrun.runtime.parallel.expert.names import all_expert_names
from dsrun.runtime.engine.train_state import TrainingParts
from dsrun.runtime.parallel.tensor.split import split_of
from dsrun.runtime.zero.groups import RankGroup
from dsrun.runtime.zero.params import record_of


def held_pieces(parts: TrainingParts) -> list[HeldPiece]:
    """Every piece of the module this rank holds: the strategy's own
    (ZeRO partitions) and every other parameter and buffer whole; those of
    tensor-parallel parameters carry their split and the full shape (see
    [Note: tensor-parallel checkpoints] in tensor_split.py)."""
    managed = {id(p) for p in parts.strategy.managed_params()}
    mesh = parts.mesh
    if parts.split is not None:  # see [Note: a model split across ranks]
        world = parts.split.replicas
    elif mesh.size("model") > 1:  # each model rank's data x sequence ranks hold its copy of the replicated tensors
        data = mesh.axis_group("sequence_data")
        world = RankGroup(data.group, data.rank, data.size)
    else:
        world = RankGroup(None, parts.topology.rank, parts.topology.world_size)
    pieces = parts.strategy.checkpoint_pieces() + plain_pieces(parts.module, parts.optimizer, managed, world, mesh)
    splits = {name: s for name, p in parts.module.named_parameters() if (s := split_of(p)) is not None}
    for piece in pieces:
        if piece.kind == "param" and piece.name in splits:
            piece.split = splits[piece.name]
            piece.shape = splits[piece.name].full_shape
    return pieces


def written_by_model_rank_zero(parts: TrainingParts) -> bool:
    """Whether this rank writes the tensors every model rank holds alike
    (replicated ones: all but tensor-parallel slices): model rank 0 only."""
    return parts.mesh.rank("model") == 0


def global_names(parts: TrainingParts) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Name -> (global shape, frozen) of every parameter and persistent
    buffer (all ranks agree: read from the module; expert parameters under
    every global expert name, [Note: expert names in checkpoints] in
    dsrun/runtime/parallel/expert/names.py)."""
    out = {}
    for name, p in parts.module.named_parameters():
        rec, split = record_of(p), split_of(p)
        shape = split.full_shape if split is not None else tuple(rec.shape) if rec is not None else tuple(p.shape)
        for global_name in all_expert_names(name, p, parts.mesh):  # an expert stands for every expert-parallel rank's
            out[global_name] = (tuple(shape), not p.requires_grad)
    for mod_name, mod in parts.module.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{bname}" if mod_name else bname] = (tuple(buf.shape), False)
    return out


def model_names(parts: TrainingParts) -> dict[str, tuple[tuple[int, ...], bool]]:
    """`global_names` of the whole model: with a split, the union over the
    parts (collective over `split.parts_group`: every rank calls it); see
    [Note: a model split across ranks]."""
    own = global_names(parts)
    split = parts.split
    if split is None or split.parts_group is None:
        return own
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for names in comm.all_gather_object(own, group=split.parts_group):
        out.update(names)
    return out


def written_elsewhere(parts: TrainingParts) -> frozenset[str]:
    """Names of this rank's tensors that another part writes (tied copies;
    see [Note: a model split across ranks])."""
    return parts.split.duplicates if parts.split is not None else frozenset()


def optimizer_extras(parts: TrainingParts) -> dict[str, torch.Tensor]:
    """Tensors a 1-bit optimizer keeps outside its per-parameter state (see
    [Note: error buffers in checkpoints] in dsrun/runtime/fp16/onebit/base.py):
    "optim_rank/rank<r>/<key>" for this rank's own, "optim_shared/<key>"
    (rank 0 writes them) for those every rank holds alike; {} for any
    other optimizer."""
    optimizer, rank = parts.optimizer, parts.topology.rank
    if not isinstance(optimizer, CompressedCommOptimizer):
        return {}
    out = {f"optim_rank/rank{rank}/{k}": t for k, t in optimizer.checkpoint_extras().items()}
    if rank == 0:
        out.update({f"optim_shared/{k}": t for k, t in optimizer.replicated_extras().items()})
    return out

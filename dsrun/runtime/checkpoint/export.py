"""The 16-bit export: the full model in the compute dtype, one safetensors file from rank 0."""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from dsrun.runtime import comm
from dsrun.runtime.checkpoint.rendezvous import Rendezvous, raise_unless_all
from dsrun.runtime.checkpoint.store import atomic_write, fsync_dir, stream_safetensors
from dsrun.runtime.checkpoint.tensor_split import assemble, contributes
from dsrun.runtime.parallel.expert.groups import expert_group_name_of, expert_groups
from dsrun.runtime.parallel.expert.names import all_expert_names
from dsrun.runtime.parallel.tensor.split import split_of
from dsrun.runtime.zero.params import record_of
from dsrun.runtime.engine.train_state import TrainingParts

log = logging.getLogger("dsrun.checkpoint")

_warned_bin = False


def full_16bit_entries(parts: TrainingParts, exclude_frozen_parameters: bool = False) -> list[tuple]:
    """What a 16-bit export holds, in state-dict order: (names, tensor, full
    shape, dtype to write, managed by the strategy) for every parameter (tied
    ones once) and persistent buffer of the module. `names` is [the name],
    or for an expert parameter the global names of it on every rank of its
    expert-parallel group, in group-rank order ([Note: expert names in
    checkpoints] in dsrun/runtime/parallel/expert/names.py): the export
    holds every expert, named as in the model without expert parallelism.
    Local; gathers nothing."""
    strategy = parts.strategy
    entries = []
    for name, p in parts.module.named_parameters():
        if exclude_frozen_parameters and not p.requires_grad:
            continue
        split = split_of(p)
        names = all_expert_names(name, p, parts.mesh)
        if strategy.manages(p):
            shape = split.full_shape if split is not None else tuple(record_of(p).shape)
            entries.append((names, p, shape, strategy.compute_dtype, True))
        else:
            entries.append((names, p, split.full_shape if split is not None else tuple(p.shape), p.dtype, False))
    for mod_name, mod in parts.module.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                name = f"{mod_name}.{bname}" if mod_name else bname
                entries.append(([name], buf, tuple(buf.shape), buf.dtype, False))
    return entries


def _specs(entries: list[tuple]) -> list[tuple]:
    """(name, full shape, export dtype) of every tensor the entries write."""
    return [(name, shape, dtype) for names, _, shape, dtype, _ in entries for name in names]


def full_16bit_values(parts: TrainingParts, entries: list[tuple]):
    """Yield the full value of each name of each entry (`_specs` order) in
    its export dtype and shape; a collective per strategy-managed,
    tensor-parallel or expert entry (a tensor-parallel slice is assembled
    over its pipeline stage, see tensor_split.py; an expert is gathered
    over its expert-parallel group), so every rank must exhaust it."""
    mesh = parts.mesh
    for names, t, shape, dtype, managed in entries:
        full = parts.strategy.full_fp32_param(t) if managed else t.detach()  # collective when managed
        split = split_of(t)
        if split is not None:
            writes = contributes(t) and mesh.rank("data") == 0  # every data rank holds the same slice
            held = [(0, full.numel(), full.reshape(-1))] if writes else []
            full = assemble(split, held, dtype, mesh, full.device)
        full = full.to(dtype).reshape(shape).contiguous()
        if len(names) == 1:
            yield full
            continue
        copies = full.new_empty((len(names), full.numel()))  # one per expert-parallel rank, in group-rank order
        comm.all_gather_into_tensor(copies.reshape(-1), full.reshape(-1),
                                    group=expert_groups(expert_group_name_of(t), mesh).ep_group)
        yield from (copy.reshape(shape) for copy in copies)


def model_16bit(parts: TrainingParts, exclude_frozen_parameters: bool = False):
    """The whole model's 16-bit export: (specs, values) where specs lists
    (name, full shape, export dtype) of every entry in state-dict order and
    `values` yields each one's full value, on every rank (collective: every
    rank must exhaust `values`).

    With a model split across ranks (a pipeline, `parts.split`), the specs
    are gathered over the parts in part order (a tied copy once, from the
    lowest part holding it) and each value is broadcast over
    `split.parts_group` from the part that holds it, so every rank sees the
    whole model, one tensor at a time."""
    entries = full_16bit_entries(parts, exclude_frozen_parameters)
    split = parts.split
    if split is None or split.parts_group is None:
        return _specs(entries), full_16bit_values(parts, entries)
    entries = [e for e in entries if e[0][0] not in split.duplicates]
    mine = _specs(entries)
    per_part = comm.all_gather_object(mine, group=split.parts_group)
    me = split.part_ranks.index(parts.topology.rank)

    def values():
        device = parts.topology.device
        for part, specs in enumerate(per_part):
            own = full_16bit_values(parts, entries) if part == me else None
            for _, shape, dtype in specs:
                value = next(own).contiguous() if own is not None else torch.empty(shape, dtype=dtype, device=device)
                comm.broadcast(value, src=split.part_ranks[part], group=split.parts_group)
                yield value
    return [spec for specs in per_part for spec in specs], values()


def save_16bit(parts: TrainingParts, rdv_factory: Callable[[str], Rendezvous], save_dir: str,
               save_filename: str = "model.safetensors", exclude_frozen_parameters: bool = False) -> str:
    """Write the module's full state dict in the compute dtype (parameters;
    persistent buffers in their own dtype) as ONE safetensors file from
    rank 0 (collective: every rank).

    Parameters are gathered one at a time (an all-reduce of the fp32 master
    pieces at stages 1-3) and streamed into the file, so rank 0 holds one
    full parameter at a time, not the model (a pipeline's stages send
    theirs to rank 0 in turn, see `model_16bit`). Tied parameters appear once,
    under their first name. MoE experts appear under their global expert
    ids, gathered over each expert-parallel group: the file is the state
    dict of the same model built with ep_size=1. A DeepSpeed-style "*.bin" name is replaced by
    its safetensors equivalent ("pytorch_model.bin" -> "model.safetensors"),
    with a warning. Returns the file's path. Raises CheckpointError on every
    rank when rank 0 cannot write.
    """
    global _warned_bin
    if save_filename.endswith(".bin"):
        new = ("model.safetensors" if save_filename == "pytorch_model.bin"
               else save_filename[:-len(".bin")] + ".safetensors")
        if not _warned_bin and parts.topology.rank == 0:
            log.warning("save_16bit_model writes safetensors, never pickles: %s becomes %s", save_filename, new)
        _warned_bin = True
        save_filename = new
    rdv = rdv_factory(save_filename)
    specs, gen = model_16bit(parts, exclude_frozen_parameters)
    path = os.path.join(save_dir, save_filename)
    error = None
    if parts.topology.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            atomic_write(path, stream_safetensors(specs, gen, {"format": "pt"}))
            fsync_dir(save_dir)
        except Exception as e:
            error = e
    for _ in gen:  # the other ranks (and rank 0 after a failure) still join every gather
        pass
    raise_unless_all(rdv.agree("written", error is None), error, f"saving the 16-bit model to {path}")
    return path

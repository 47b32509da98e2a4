"""What one rank holds of the model: pieces of flattened global tensors.

A checkpoint never records the in-memory layout (flat buffers, buckets,
spans). It records, per global tensor (a parameter or buffer of the module,
by qualified name), which element ranges [lo, hi) of its flattened value are
stored where. A `HeldPiece` is the bridge from a rank's memory to that
description: elements [lo, hi) of tensor `name` live in `value` (1-D, hi-lo
elements), and their optimizer states in `optimizer.state[state_key]` at
flattened offset `state_offset`.

Every strategy produces its pieces here or in `ZeroStrategy.checkpoint_pieces`
(ZeRO-managed parameters); parameters no ZeRO strategy manages (stage 0 in
fp32, frozen parameters at stages 1-2) and buffers are *plain*: every rank
holds all of them.

A piece held by several ranks (replicas) is written once: replica q of R
writes the q-th of R even sub-ranges [write_lo, write_hi). A load reads the
same sub-range on each replica and broadcasts it to the others, so the whole
[lo, hi) is filled on every replica (see [Note: replicated loads] in
checkpointer.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsrun.runtime.parallel.expert.groups import is_expert_param
from dsrun.runtime.parallel.expert.names import expert_holders, global_expert_name
from dsrun.runtime.parallel.mesh import ParallelMesh


@dataclass
class HeldPiece:
    """Elements [lo, hi) of the flattened global tensor `name`, held by this rank.

    name: qualified parameter or buffer name in the module.
    shape: the global tensor's shape. kind: "param" or "buffer".
    lo, hi: element range held (and filled on load).
    write_lo, write_hi: the sub-range this rank writes on save (replicas split).
    value: 1-D view (hi - lo,) of where the values live: the fp32 master for
        trainable ZeRO parameters, else the tensor's own storage (its dtype).
        Writing into it is how a load restores the values.
    trainable: has an optimizer state (state_key is not None).
    state_key: the tensor keying `optimizer.state` for these elements.
    state_offset: flattened offset of element `lo` inside that state's tensors.
    replicas: the ranks that hold these same elements, this one included
        (an object with .group, a torch ProcessGroup or None for the default
        group, .rank and .size: zero.groups.RankGroup); None when no other
        rank does. [write_lo, write_hi) is then this rank's even part: a load
        reads only that part and takes the rest from the replicas (see
        [Note: replicated loads] in checkpointer.py).
    split: for a tensor-parallel parameter, where its slice sits in the full
        tensor (dsrun.runtime.parallel.tensor.split.TensorSplit); [lo, hi)
        are then elements of the flattened *slice*, `shape` the full
        tensor's (see [Note: tensor-parallel checkpoints] in tensor_split.py).
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    lo: int
    hi: int
    write_lo: int
    write_hi: int
    value: torch.Tensor
    trainable: bool = False
    state_key: torch.Tensor | None = None
    state_offset: int = 0
    replicas: Any = None
    split: Any = None


def even_part(lo: int, hi: int, index: int, parts: int) -> tuple[int, int]:
    """The index-th of `parts` near-equal consecutive sub-ranges of [lo, hi)."""
    n = hi - lo
    return lo + n * index // parts, lo + n * (index + 1) // parts


def flat_view(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` as a 1-D view of its storage. Raises ValueError if not contiguous
    (a load could not write through a copy)."""
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous; checkpoints need contiguous tensors")
    return t.view(-1)


def plain_pieces(module: torch.nn.Module, optimizer: torch.optim.Optimizer, skip: set[int],
                 world: Any, mesh: ParallelMesh) -> list[HeldPiece]:
    """Pieces of every parameter not in `skip` (ids of ZeRO-managed ones) and of
    every persistent buffer: every rank of `world` (the job's RankGroup)
    holds all elements and writes an even 1/world.size slice; an expert
    parameter goes by its global expert name, held by its expert-data-
    parallel group on `mesh` (see [Note: expert names in checkpoints] in
    dsrun/runtime/parallel/expert/names.py). Optimizer state key: the
    parameter itself when the optimizer holds it."""
    rank, world_size = world.rank, world.size
    replicas = world if world_size > 1 else None
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    pieces = []
    for name, p in module.named_parameters():
        if id(p) in skip:
            continue
        n = p.numel()
        holders = world
        if is_expert_param(p):  # by global expert id, held by its expert-data-parallel group (names.py)
            name, holders = global_expert_name(name, p, mesh), expert_holders(p, mesh)
        wlo, whi = even_part(0, n, holders.rank, holders.size)
        trainable = id(p) in in_optimizer
        pieces.append(HeldPiece(name, tuple(p.shape), "param", 0, n, wlo, whi, flat_view(p.data, name),
                                trainable, p if trainable else None, 0,
                                replicas if holders is world else (holders if holders.size > 1 else None)))
    for mod_name, mod in module.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is None or bname in mod._non_persistent_buffers_set:
                continue
            name = f"{mod_name}.{bname}" if mod_name else bname
            n = buf.numel()
            wlo, whi = even_part(0, n, rank, world_size)
            pieces.append(HeldPiece(name, tuple(buf.shape), "buffer", 0, n, wlo, whi, flat_view(buf, name),
                                    replicas=replicas))
    return pieces

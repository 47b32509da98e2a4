"""Checkpoints of tensor-parallel parameters: the full tensor is stored, any
tensor-parallel size reads its slice back.

[Note: tensor-parallel checkpoints]
A tensor-parallel parameter is a slice of a full tensor
(`param.tp_split`, dsrun/runtime/parallel/tensor/split.py); under ZeRO
each data rank holds a range of that slice's flattened elements. A
checkpoint stores tensors as ranges of their flattened *full* value (see
pieces.py), so the slice of a row-parallel weight (out, in/tp), of a fused
q/k/v weight or of GPT-2's transposed Conv1D is no range of it; worse, a
ZeRO range of the slice is a strided set of elements of the full tensor.

Save therefore assembles each such tensor whole before writing it, one
parameter (and one optimizer state) at a time: every rank writes the
elements it holds into a zeroed buffer of the full size at their
`local_index()` positions, viewed as integers of the same width, and the
buffers are summed over the data axis (data x sequence: the sequence ranks
are data replicas of the weights), then the model axis (the ranks of one
pipeline stage hold the whole tensor between them). Each element is
written by exactly one rank (a piece held by data-parallel replicas by the
one whose even part it is, `HeldPiece.write_lo/write_hi`; a key/value head
replicated over the model axis by the first rank of its `tp_replica_group`),
so the integer sum is that rank's bit pattern: values, -0.0 and NaNs
survive bit for bit. Each rank of the stage then writes its even part of
the full tensor under the parameter's name, as if the model were never
split: the unsharded model, and any other tensor-parallel size or ZeRO
stage, load it by name. The cost is one full-size buffer and two
all-reduces per tensor-parallel parameter and optimizer state (the same
bytes as an all-gather of the model, once per save).

Load reads, for each range [lo, hi) of a slice this rank holds, the range
of the full tensor that covers its elements' positions, and picks the
elements out (`SplitRead`): a column-parallel slice reads exactly its
rows, a row-parallel or transposed one the rows its columns cross (up to
the whole tensor). Replicated parameters (LayerNorm, embeddings, a row-
parallel bias) are ordinary pieces; every model rank holds them alike, and
only model rank 0 writes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsrun.runtime import comm
from dsrun.runtime.checkpoint.pieces import HeldPiece, even_part
from dsrun.runtime.checkpoint.store import dtype_name, dtype_of
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.parallel.tensor.split import TensorSplit

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def contributes(param: torch.Tensor) -> bool:
    """Whether this rank writes the elements of `param` it holds: not when
    another model rank holds the same key/value head and writes it (see
    autotp.py [Note: attention heads])."""
    replica = getattr(param, "tp_replica_group", None)
    return replica is None or replica.rank == 0


def _as_wide_int(values: torch.Tensor) -> torch.Tensor:
    """The bit patterns of `values` as int32 (1- and 2-byte dtypes, zero-
    extended) or int64 (8-byte): an integer sum of one pattern and zeros is
    the pattern."""
    width = values.element_size()
    bits = values.contiguous().view(_INT_OF_WIDTH[width])
    if width < 4:
        return bits.to(torch.int32) & ((1 << (8 * width)) - 1)
    return bits


def _from_wide_int(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    width = torch.empty((), dtype=dtype).element_size()
    if width < 4:
        bits = bits.to(_INT_OF_WIDTH[width])  # wraps: the low bits are the pattern
    return bits.view(dtype)


def assemble(split: TensorSplit, held: list[tuple[int, int, torch.Tensor]], dtype: torch.dtype,
             mesh: ParallelMesh, device: torch.device) -> torch.Tensor:
    """The full tensor (1-D, flattened `split.full_shape`, `dtype`) from the
    elements every rank of this rank's pipeline stage holds (collective over
    the mesh's sequence_data and model groups: each of their ranks calls it for the
    same tensors in the same order). See [Note: tensor-parallel checkpoints].

    held: (lo, hi, values) for each range [lo, hi) of this rank's slice
        (flattened) it writes; values 1-D (hi - lo,), any dtype of `dtype`'s
        width. The ranges of all ranks must cover the full tensor once.
    """
    numel = 1
    for d in split.full_shape:
        numel *= d
    width = torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(numel, dtype=torch.int64 if width == 8 else torch.int32, device=device)
    if held:
        index = split.local_index().view(-1).to(device)
        for lo, hi, values in held:
            if hi > lo:
                buf[index[lo:hi]] = _as_wide_int(values.to(dtype).to(device))
    for axis in ("sequence_data", "model"):  # the data axis of a stage: data x sequence ranks
        group = mesh.axis_group(axis)
        if group.size > 1:
            comm.all_reduce(buf, group=group.group)
    return _from_wide_int(buf, dtype)


def stage_part(numel: int, mesh: ParallelMesh) -> tuple[int, int]:
    """This rank's even part [lo, hi) of a full tensor its stage's ranks
    (data x sequence x model) split the writing of."""
    data, model = mesh.axis_group("sequence_data"), mesh.axis_group("model")
    return even_part(0, numel, model.rank * data.size + data.rank, model.size * data.size)


@dataclass
class SplitRead:
    """One read of a slice's range: elements [first, last) of the full
    tensor land in `scratch`; `dest` (1-D, the slice's elements [lo, hi))
    then takes `scratch[offsets]` (`finish`)."""

    first: int
    last: int
    scratch: torch.Tensor
    dest: torch.Tensor
    offsets: torch.Tensor

    def finish(self) -> None:
        with torch.no_grad():
            self.dest.copy_(self.scratch[self.offsets])


def split_read(piece: HeldPiece, split: TensorSplit, dest: torch.Tensor) -> SplitRead | None:
    """The read filling `dest` (1-D, `piece`'s elements [lo, hi) of the
    slice) from the stored full tensor; None for an empty piece."""
    if piece.hi <= piece.lo:
        return None
    positions = split.local_index().view(-1)[piece.lo:piece.hi]
    first, last = int(positions.min()), int(positions.max()) + 1
    scratch = torch.empty(last - first, dtype=dest.dtype)
    return SplitRead(first, last, scratch, dest, positions - first)


@dataclass
class Assembled:
    """What this rank writes of the tensor-parallel parameters: `tensors`,
    (global key, full shape, 1-D values, lo, hi) of each even part, and
    `scalars`, parameter name -> {0-dim optimizer state key: value record}."""

    tensors: list[tuple[str, tuple[int, ...], torch.Tensor, int, int]]
    scalars: dict[str, dict[str, dict]]


def _state_of(optimizer: torch.optim.Optimizer, piece: HeldPiece) -> dict:
    return optimizer.state.get(piece.state_key, {}) if piece.state_key is not None else {}


def _elementwise(piece: HeldPiece, value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == piece.state_key.numel()


def assemble_split_tensors(optimizer: torch.optim.Optimizer, pieces: list[HeldPiece],
                           order: list[tuple[str, TensorSplit, bool]], mesh: ParallelMesh,
                           device: torch.device) -> Assembled:
    """The full value and element-wise optimizer states of every
    tensor-parallel parameter in `order`, assembled (see [Note:
    tensor-parallel checkpoints]) and cut into this rank's even part.
    Collective over the whole job (one all_gather_object of what each rank
    holds, then `assemble` per tensor over the stage's data and model axes).

    order: (name, split, writes) of this stage's tensor-parallel parameters
        in module order, the same on every rank of the stage; `writes`:
        `contributes(param)`.
    pieces: this rank's pieces (those with a `split` are used).
    """
    mine: dict[str, tuple[str, dict[str, str]]] = {}
    for p in pieces:
        if p.split is not None:
            keys = {k: dtype_name(v.dtype) for k, v in _state_of(optimizer, p).items() if _elementwise(p, v)}
            mine[p.name] = (dtype_name(p.value.dtype), keys)
    known: dict[str, tuple[str, dict[str, str]]] = {}
    for other in comm.all_gather_object(mine):
        for name, (dtype, keys) in other.items():
            known.setdefault(name, (dtype, {}))[1].update(keys)
    out = Assembled([], {})
    for name, split, writes in order:
        if name not in known:  # no rank holds a piece (an excluded frozen parameter)
            continue
        own = [p for p in pieces if p.name == name and p.split is not None]
        numel = 1
        for d in split.full_shape:
            numel *= d
        lo, hi = stage_part(numel, mesh)
        writers = [p for p in own if writes]

        def part(key: str | None, dtype: torch.dtype) -> torch.Tensor:
            held = []
            for p in writers:
                a, b = p.write_lo - p.lo, p.write_hi - p.lo
                if key is None:
                    values = p.value[a:b]
                else:
                    values = _state_of(optimizer, p)[key].reshape(-1)[p.state_offset + a:p.state_offset + b]
                held.append((p.write_lo, p.write_hi, values))
            return assemble(split, held, dtype, mesh, device)[lo:hi].clone()
        dtype, keys = known[name]
        out.tensors.append((f"module/{name}", split.full_shape, part(None, dtype_of(dtype)), lo, hi))
        for key in sorted(keys):
            out.tensors.append((f"optim/{name}/{key}", split.full_shape, part(key, dtype_of(keys[key])), lo, hi))
        for p in own:
            for key, v in _state_of(optimizer, p).items():
                if isinstance(v, torch.Tensor) and v.dim() == 0:
                    out.scalars.setdefault(name, {})[key] = {"value": v.item(), "dtype": dtype_name(v.dtype)}
                elif isinstance(v, (int, float, bool)):
                    out.scalars.setdefault(name, {})[key] = {"value": v, "dtype": None}
    return out

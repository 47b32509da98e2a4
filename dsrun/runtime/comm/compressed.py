"""Error-compensated 1-bit all-reduce (the communication of 1-bit Adam, 0/1 Adam and 1-bit LAMB).

[Note: two-phase compressed all-reduce]
Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed" (ICML 2021), Section 4.1 and Algorithm 1's
communication, as DeepSpeed implements it (a compressed all-to-all, then
a compressed all-gather). On p ranks, each holding a 1-D fp32 tensor x_i
of n elements, padded with zeros to N (a multiple of 8·p) and cut into p
chunks of N/p elements:

1. Worker (every rank i): y = x_i + e_i (e_i its worker error, n fp32).
   For each chunk j: s_ij = ‖y_j‖ / √(real elements of y_j), the 1-bit
   value is s_ij·sign(y_j) (sign(0) = +1, as DeepSpeed), and the new
   worker error is e_i = y - (that value), padding excluded.
2. All-to-all: chunk j of every rank goes to rank j as packed sign bits
   (1 bit per element in uint8, most significant bit first, as
   numpy.packbits) followed by its 4-byte fp32 scale.
3. Server (rank j, for chunk j): z = (1/p)·Σ_i s_ij·sign_ij + E_j, where
   E_j is its server error (N/p fp32); compressed the same way with one
   scale; E_j = z - (its 1-bit value), padding excluded.
4. All-gather: every rank receives every server chunk (bits + scale) and
   writes the concatenation, truncated to n, into x.

Every rank ends with the same tensor, an estimate of the mean of the x_i.
The errors carry what compression dropped into the next call (error
feedback), so the running sum of results tracks the running sum of the
true means with a bounded error (Tang et al., Theorem 1's assumption).
DeepSpeed uses one worker scale for the whole tensor; here each chunk has
its own (its scale travels with the chunk anyway, so the bytes are the same
and the value is closer).

Bytes each rank sends (comms logger `bus_bytes`): (p-1)/p·(N/8 + 4p) in
each phase, against 2(p-1)/p·2n for an fp16 all-reduce of the same tensor:
16x fewer for the sign bits, minus 4 bytes of scale per chunk per phase.

Sign packing, unpacking and the sign + error step run in the native kernels
of dsrun.ops.quantizer when they are built, this module's PyTorch code
otherwise (the same bits); the scales (vector_norm) are always PyTorch's.
"""
from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from dsrun.ops import quantizer
from dsrun.runtime.comm.collectives import all_gather_into_tensor, all_to_all_single, get_rank, get_world_size

__all__ = ["pack_signs", "unpack_signs", "padded_numel", "server_chunk_numel", "compress_chunks",
           "compressed_all_reduce", "compressed_bus_bytes"]

_SCALE_BYTES = 4
_LUTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Sign bits of `x` (1-D, numel a multiple of 8): 1 where x >= 0.

    Returns uint8 [numel/8], the first element in the most significant bit.
    Raises ValueError when numel is not a multiple of 8.
    """
    if x.dim() != 1 or x.numel() % 8:
        raise ValueError(f"pack_signs needs a 1-D tensor of a multiple of 8 elements, got {tuple(x.shape)}")
    native = quantizer.sign_pack(x)  # the native kernel when built for x's device and dtype: the same bits
    return native if native is not None else _pack_signs_torch(x)


def _pack_signs_torch(x: torch.Tensor) -> torch.Tensor:
    """The PyTorch path of `pack_signs` (and the kernels' reference)."""
    bits = (x >= 0).view(torch.uint8).view(-1, 8)
    out = bits[:, 0] << 7
    for i in range(1, 8):  # eight strided passes over n/8 bytes: cheaper than a [n/8, 8] reduction
        out |= bits[:, i] << (7 - i)
    return out


def _lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8] table: row b holds the ±1 values of byte b's bits, most significant first."""
    key = (device, dtype)
    if key not in _LUTS:
        byte = torch.arange(256).unsqueeze(1)
        bits = (byte >> torch.arange(7, -1, -1)) & 1
        _LUTS[key] = (bits * 2 - 1).to(device=device, dtype=dtype)
    return _LUTS[key]


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 values of packed sign bits: uint8 [m] -> `dtype` [8m] (+1 for a set bit);
    native kernel or PyTorch, as pack_signs."""
    native = quantizer.sign_unpack(packed, dtype, 8 * packed.numel())
    return native if native is not None else _unpack_signs_torch(packed, dtype)


def _unpack_signs_torch(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The PyTorch path of `unpack_signs` (and the kernels' reference)."""
    return _lut(packed.device, dtype).index_select(0, packed.reshape(-1).int()).reshape(-1)


def padded_numel(numel: int, world: int) -> int:
    """numel rounded up to a multiple of 8·world (whole bytes in every chunk)."""
    unit = 8 * world
    return -(-numel // unit) * unit


def server_chunk_numel(numel: int, world: int) -> int:
    """Elements of each rank's chunk (and server error) for an n-element tensor."""
    return padded_numel(numel, world) // world


def compress_chunks(y: torch.Tensor, real: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-bit compression of each row of `y` (fp32 [chunks, c], c a multiple of 8).

    real[k]: how many leading elements of row k are real; the rest is
    padding, zeroed in `y` (in place), with no weight in the scale and no
    error.

    Returns (packed uint8 [chunks, c/8], scales fp32 [chunks], error fp32
    [chunks, c] = y - scale·sign(y), zero on padding).
    """
    chunks, width = y.shape
    scales = _chunk_scales(y, real)
    error = torch.empty_like(y)
    packed = _signs_and_error(y, real, scales, error.view(-1))
    return packed.view(chunks, width // 8), scales, error


def _chunk_scales(y: torch.Tensor, real: list[int]) -> torch.Tensor:
    """Zero the padding of `y` (fp32 [chunks, c]) in place; fp32 [chunks]: each row's RMS over its real elements.
    (Always PyTorch: a kernel could not sum in vector_norm's order, which depends on torch's own SIMD level.)"""
    for k, r in enumerate(real):
        y[k, r:] = 0.0
    count = torch.tensor([max(r, 1) for r in real], dtype=torch.float32, device=y.device)
    return torch.linalg.vector_norm(y, dim=1) / count.sqrt()


def _signs_and_error(y: torch.Tensor, real: list[int], scales: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """Packed sign bits of `y` (fp32 [chunks, c], padding zero), uint8 [chunks·c/8]; writes the first
    error.numel() values of y - scale·sign(y) (0 on padding) into `error` (fp32, 1-D). One pass of the native
    kernel when it is built (the 1-bit optimizers' error feedback), else PyTorch; the same bits."""
    native = quantizer.onebit_compress(y, real, scales, error)
    if native is not None:
        return native
    chunks, width = y.shape
    packed = _pack_signs_torch(y.reshape(-1))
    full = y - _unpack_signs_torch(packed).view(chunks, width).mul_(scales.unsqueeze(1))
    for k, r in enumerate(real):
        full[k, r:] = 0.0
    error.copy_(full.view(-1)[:error.numel()])
    return packed


def _unpack_scaled(bits: torch.Tensor, scales: torch.Tensor, chunk: int, out: torch.Tensor) -> torch.Tensor:
    """out (fp32, 1-D, n <= 8·bits.numel()) = the first n values of ±1 · scales[i // chunk]."""
    if quantizer.sign_unpack(bits, torch.float32, out.numel(), scales, chunk, out=out) is None:
        values = _unpack_signs_torch(bits.reshape(-1)).view(-1, chunk).mul_(scales.unsqueeze(1))
        out.copy_(values.view(-1)[:out.numel()])
    return out


def _with_scales(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [chunks, c/8 + 4]: each row's bits followed by its fp32 scale's bytes."""
    return torch.cat([packed, scales.reshape(-1, 1).contiguous().view(torch.uint8)], dim=1)


def _split_scales(message: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_with_scales` on a flat received buffer: (bits [rows, c/8], scales [rows])."""
    message = message.view(rows, -1)
    return message[:, :-_SCALE_BYTES], message[:, -_SCALE_BYTES:].contiguous().view(torch.float32).reshape(-1)


def _real_counts(numel: int, world: int) -> list[int]:
    chunk = server_chunk_numel(numel, world)
    return [max(0, min(chunk, numel - j * chunk)) for j in range(world)]


@torch.no_grad()
def compressed_all_reduce(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                          group: ProcessGroup | None = None) -> torch.Tensor:
    """Replace `buffer` by the error-compensated 1-bit estimate of its mean over `group`.

    See [Note: two-phase compressed all-reduce]. Collective: every rank of
    `group` calls it with tensors of the same size, in the same order.

    Args:
        buffer: 1-D fp32, n elements; overwritten with the same estimate on
            every rank.
        worker_error: fp32 [n], this rank's worker error (updated in place).
        server_error: fp32 [server_chunk_numel(n, world)], this rank's server
            error (updated in place).
        group: process group (None = all ranks). With one rank the buffer
            is its own mean: returned unchanged, nothing compressed.

    Returns:
        `buffer`.

    Raises:
        ValueError: wrong shapes or dtypes (before any communication).
    """
    world, n = get_world_size(group), buffer.numel()
    chunk = server_chunk_numel(n, world)
    for name, t, want in (("buffer", buffer, n), ("worker_error", worker_error, n),
                          ("server_error", server_error, chunk)):
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != want or not t.is_contiguous():
            raise ValueError(f"compressed_all_reduce: {name} must be a contiguous 1-D fp32 tensor of {want} "
                             f"elements, got {t.dtype} {tuple(t.shape)}")
    if world == 1:
        return buffer
    rank, real = get_rank(group), _real_counts(n, world)
    y = torch.zeros(world * chunk, dtype=torch.float32, device=buffer.device)
    torch.add(buffer, worker_error, out=y[:n])
    y = y.view(world, chunk)
    scales = _chunk_scales(y, real)
    packed = _signs_and_error(y, real, scales, worker_error).view(world, chunk // 8)

    # Phase 1: chunk j (bits + scale) to rank j.
    send = _with_scales(packed, scales).reshape(-1)
    received = torch.empty_like(send)
    all_to_all_single(received, send, group=group)
    bits, worker_scales = _split_scales(received, world)
    z = _unpack_scaled(bits, worker_scales / world, chunk, torch.empty(world * chunk, device=buffer.device))
    z = z.view(world, chunk).sum(dim=0).add_(server_error).unsqueeze(0)
    s_scale = _chunk_scales(z, [real[rank]])
    s_packed = _signs_and_error(z, [real[rank]], s_scale, server_error).view(1, chunk // 8)

    # Phase 2: every server chunk (bits + scale) to every rank.
    mine = _with_scales(s_packed, s_scale).reshape(-1)
    gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=buffer.device)
    all_gather_into_tensor(gathered, mine, group=group)
    bits, server_scales = _split_scales(gathered, world)
    return _unpack_scaled(bits, server_scales, chunk, buffer)


def compressed_bus_bytes(numel: int, world: int) -> int:
    """Bytes each rank sends in one compressed_all_reduce of `numel` elements
    (the comms logger's bus_bytes), for sizing and benchmarks."""
    if world == 1:
        return 0
    per_phase = world * (server_chunk_numel(numel, world) // 8 + _SCALE_BYTES)
    return 2 * round(per_phase * (world - 1) / world)


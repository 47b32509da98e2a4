"""Block-wise int8 and int4 quantization for ZeRO++ (qwZ weights, qgZ gradients).

Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
Giant Model Training" (2023), Section 3.1: each block of `block` elements
is sent as int8 with its own scale, symmetric:

    s = max|x_block| / 127,   q = round(x / s) clamped to [-127, 127],   x' = q·s

(a block of zeros gets s = 0 and decodes to zeros). A per-block scale keeps
the error of a block proportional to that block's own range, not to the
largest weight of the tensor (the paper's Figure 3). The fp32 scales ride
in the same message, after the int8 values: one all-gather per region.

[Note: int4 layout]
Section 3.3 (qgZ) sends gradients as int4, same idea with 15 levels. The
layout, which a native kernel must reproduce bit for bit:

- blocks of `block` elements (even), the input converted to fp32 first and
  the tail of the last block padded with zeros;
- scale (fp32, one per block) s = max|x_block| / 7, computed as an fp32
  division; q = round(x / s) (fp32 division, round half to even, as
  torch.round / nearbyint), clamped to [-7, 7]; a block with s = 0 (all
  zeros, or values so small that s underflows) has q = 0;
- non-finite values: a block holding any inf or NaN gets s = NaN and q = 0,
  so EVERY element of that block decodes to NaN. Nothing non-finite is
  dropped: a sum it enters is NaN, and fp16 overflow detection (a
  non-finite gradient norm) sees it;
- codes are stored offset by 8 as nibbles (q + 8 in [1, 15]), two per
  byte: element 2i in the low nibble of byte i, element 2i+1 in the high
  nibble;
- decoding: x' = (nibble - 8) * s in fp32.
A message (`pack_int4_rows`) is one row per destination: the row's codes
(padded_len / 2 bytes) then its scales' bytes (4 per block, native byte
order), so each row travels as a unit of uint8.

Quantization and dequantization run in the native kernels of
dsrun.ops.quantizer (CPU SIMD, CUDA) when they are built, the PyTorch code
below otherwise; both give the same bits (csrc/quantizer/quant_impl.h).
"""
from __future__ import annotations

import torch

from dsrun.ops import quantizer

__all__ = ["quantize_blockwise", "dequantize_blockwise", "message_numel", "pack_message", "unpack_message",
           "quantize_int4", "dequantize_int4", "int4_row_bytes", "pack_int4_rows", "unpack_int4_rows"]

INT4_MAX = 7  # symmetric levels -7..7; the nibble is q + 8


def quantize_blockwise(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: 1-D float, any length -> (int8 [ceil(n/block)·block], fp32 scales [ceil(n/block)]).

    The tail of the last block is zero padding. Runs the native kernel
    (dsrun.ops.quantizer) when it is built for x's device and dtype, this
    module's PyTorch code otherwise; both give the same bits. Raises
    ValueError for block < 1.
    """
    if block < 1:
        raise ValueError(f"quantization block must be >= 1 element, got {block}")
    native = quantizer.quantize(x, block, bits=8)
    return native if native is not None else _quantize_torch(x, block)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (any shape, n elements) as fp32 rows of `block`: shape (ceil(n/block), block), the tail zero-padded."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    return padded.view(-1, block)


def _quantize_torch(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path of `quantize_blockwise` (and the kernels' reference)."""
    view = _blocks(x, block)
    scales = view.abs().amax(dim=1) / 127.0
    q = torch.where(scales.unsqueeze(1) > 0, view / scales.unsqueeze(1).clamp(min=1e-38), 0.0)
    return q.round_().clamp_(-127, 127).to(torch.int8).view(-1), scales


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_blockwise`: int8 [b·block], fp32 [b] -> `dtype` [b·block]
    (native kernel or PyTorch, as quantize_blockwise)."""
    blocks = scales.numel()
    if blocks and q.numel() % blocks == 0:
        native = quantizer.dequantize(q, scales, q.numel() // blocks, 8, q.numel(), dtype)
        if native is not None:
            return native
    return _dequantize_torch(q, scales, dtype)


def _dequantize_torch(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch path of `dequantize_blockwise` (and the kernels' reference)."""
    blocks = scales.numel()
    return (q.view(blocks, -1).to(torch.float32) * scales.unsqueeze(1)).view(-1).to(dtype)


def message_numel(n: int, block: int) -> int:
    """Bytes of one rank's message for n values: int8 values plus 4 bytes per block."""
    blocks = -(-n // block)
    return blocks * block + 4 * blocks


def pack_message(x: torch.Tensor, block: int) -> torch.Tensor:
    """Quantize `x` and lay out the int8 values then the scales' bytes: int8 [message_numel]."""
    q, scales = quantize_blockwise(x, block)
    return torch.cat([q, scales.view(torch.int8)])


def unpack_message(message: torch.Tensor, n: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """The n decoded values of one rank's message (`dtype` [n])."""
    blocks = -(-n // block)
    q = message[:blocks * block]
    scales = message[blocks * block:].contiguous().view(torch.float32)
    native = quantizer.dequantize(q, scales, block, 8, n, dtype)  # decodes the n values only
    return native if native is not None else _dequantize_torch(q, scales, dtype)[:n]


def _check_int4_block(block: int) -> None:
    if block < 2 or block % 2:
        raise ValueError(f"int4 quantization block must be an even number >= 2 of elements, got {block}")


def quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: 1-D float, any length n -> (uint8 codes [b·block/2], fp32 scales [b]), b = ceil(n/block).

    See [Note: int4 layout] for the exact rounding, nibble order and what
    happens to inf/NaN. Native kernel or PyTorch, as quantize_blockwise.
    Raises ValueError for an odd block or block < 2.
    """
    _check_int4_block(block)
    native = quantizer.quantize(x, block, bits=4)
    return native if native is not None else _quantize_int4_torch(x, block)


def _quantize_int4_torch(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path of `quantize_int4` (and the kernels' reference)."""
    view = _blocks(x, block)
    finite = torch.isfinite(view).all(dim=1)
    scales = torch.where(finite, view.abs().amax(dim=1) / INT4_MAX, torch.nan)
    usable = (finite & (scales > 0)).unsqueeze(1)
    q = torch.where(usable, view / torch.where(usable, scales.unsqueeze(1), 1.0), 0.0)
    nibbles = q.round_().clamp_(-INT4_MAX, INT4_MAX).add_(8).to(torch.uint8).view(-1, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4), scales


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_int4`: uint8 [b·block/2], fp32 [b] -> `dtype` [b·block]
    (native kernel or PyTorch, as quantize_blockwise)."""
    blocks = scales.numel()
    if blocks and codes.numel() % blocks == 0:
        native = quantizer.dequantize(codes, scales, 2 * codes.numel() // blocks, 4, 2 * codes.numel(), dtype)
        if native is not None:
            return native
    return _dequantize_int4_torch(codes, scales, dtype)


def _dequantize_int4_torch(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch path of `dequantize_int4` (and the kernels' reference)."""
    low = (codes & 0xF).to(torch.float32)
    high = (codes >> 4).to(torch.float32)
    q = torch.stack([low, high], dim=1).view(scales.numel(), -1).sub_(8)
    return (q * scales.unsqueeze(1)).view(-1).to(dtype)


def int4_row_bytes(width: int, block: int) -> int:
    """Bytes of one packed row of `width` values: codes (padded / 2) plus 4 per block."""
    blocks = -(-width // block)
    return blocks * block // 2 + 4 * blocks


def pack_int4_rows(rows: torch.Tensor, block: int) -> torch.Tensor:
    """Quantize each row of `rows` (float [r, width]) on its own (blocks never
    span two rows): uint8 [r, int4_row_bytes(width, block)], each row its
    codes then its scales (see [Note: int4 layout])."""
    count, width = rows.shape
    blocks = -(-width // block)
    padded = torch.zeros(count, blocks * block, dtype=torch.float32, device=rows.device)
    padded[:, :width] = rows
    codes, scales = quantize_int4(padded.view(-1), block)
    return torch.cat([codes.view(count, -1), scales.view(count, blocks).view(torch.uint8)], dim=1)


def unpack_int4_rows(message: torch.Tensor, width: int, block: int) -> torch.Tensor:
    """Inverse of `pack_int4_rows`: uint8 [r, int4_row_bytes(width, block)] -> fp32 [r, width]."""
    count = message.shape[0]
    blocks = -(-width // block)
    codes = message[:, :blocks * block // 2].reshape(-1)
    scales = message[:, blocks * block // 2:].contiguous().view(torch.float32).reshape(-1)
    return dequantize_int4(codes, scales).view(count, -1)[:, :width]

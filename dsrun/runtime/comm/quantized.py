"""Block-wise int8 quantization for ZeRO++'s quantized weight all-gather (qwZ).

Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
Giant Model Training" (2023), Section 3.1: each block of `block` elements
is sent as int8 with its own scale, symmetric:

    s = max|x_block| / 127,   q = round(x / s) clamped to [-127, 127],   x' = q·s

(a block of zeros gets s = 0 and decodes to zeros). A per-block scale keeps
the error of a block proportional to that block's own range, not to the
largest weight of the tensor (the paper's Figure 3). The fp32 scales ride
in the same message, after the int8 values: one all-gather per region.
"""
from __future__ import annotations

import torch

__all__ = ["quantize_blockwise", "dequantize_blockwise", "message_numel", "pack_message", "unpack_message"]


def quantize_blockwise(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: 1-D float, any length -> (int8 [ceil(n/block)·block], fp32 scales [ceil(n/block)]).

    The tail of the last block is zero padding. Raises ValueError for block < 1.
    """
    if block < 1:
        raise ValueError(f"quantization block must be >= 1 element, got {block}")
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    view = padded.view(blocks, block)
    scales = view.abs().amax(dim=1) / 127.0
    q = torch.where(scales.unsqueeze(1) > 0, view / scales.unsqueeze(1).clamp(min=1e-38), 0.0)
    return q.round_().clamp_(-127, 127).to(torch.int8).view(-1), scales


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_blockwise`: int8 [b·block], fp32 [b] -> `dtype` [b·block]."""
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
    return dequantize_blockwise(q, scales, dtype)[:n]

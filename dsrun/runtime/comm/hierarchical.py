"""ZeRO++ qgZ: a reduce-scatter done as two quantized all-to-alls, inside each node then across nodes.

[Note: hierarchical quantized reduce-scatter]
Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
Giant Model Training" (2023), Section 3.3. The ranks form an N x L grid:
N nodes of L ranks, rank r = node k * L + local j. `intra` is this rank's
node (size L, rank j); `inter` holds the ranks with the same local rank
on every node (size N, rank k). A reduce-scatter over all W = N·L ranks
leaves rank r the sum of shard r of every rank's input. Here:

0. Reorder: rows[j, k] = shard k·L + j, so the rows a local rank j will
   own once both stages are done are contiguous (the paper's tensor
   slice reordering; without it the second stage would leave every rank
   a strided, wrong piece).
1. Intra-node: quantize rows (int4, per-block fp32 scale; see
   quantized.py [Note: int4 layout]) and all-to-all within the node:
   local rank j receives rows[j, :] from each of the L ranks of its node,
   dequantizes them and sums (fp32, in source-rank order): the node's sum
   of shards k·L + j for every node k.
2. Inter-node: quantize those N rows again and all-to-all across nodes:
   row k goes to node k. Node k's rank j dequantizes the N rows it gets
   and sums them (fp32, source order): the sum over all W ranks of shard
   k·L + j, its own.
A stage over a group of one rank is skipped (nothing is quantized for
it); with W = 1 the input is copied exactly. Every row is quantized on its
own (blocks never span two shards); each rank's own row is quantized and
decoded like the others, so the result does not depend on where a
contribution came from. Blocks with inf/NaN decode to NaN (the note in
quantized.py), so overflow survives both stages.

Bytes each rank sends, for a region of n elements (S = n/W per shard,
B the block): stage 1, the all-to-all's input of W rows of
int4_row_bytes(S, B) (about n/2 + 4n/B bytes; (L-1)/L of it leaves the
rank), stage 2 N rows (n/L elements: (N-1)/N of it crosses nodes). Against
a 2- or 4-byte reduce-scatter of n elements, int4 with a 4-byte scale per
B elements is (0.5 + 4/B)/2 or /4 of the bytes, and the inter-node part is
only the second stage: the paper's 0.25Ψ against fp16's Ψ.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from dsrun.runtime.comm.collectives import CompletedWork, Handle, _ThenWork, all_to_all_single
from dsrun.runtime.comm.quantized import pack_int4_rows, unpack_int4_rows

if TYPE_CHECKING:
    from dsrun.runtime.zero.groups import RankGroup

__all__ = ["quantized_reduce_scatter"]


def _sum_rows(message: torch.Tensor, width: int, block: int) -> torch.Tensor:
    """Decode every source's rows of a received all-to-all buffer (uint8
    [sources, rows, row bytes]) and sum them in source order: fp32 [rows, width]."""
    total = unpack_int4_rows(message[0], width, block).clone()
    for src in range(1, message.shape[0]):
        total += unpack_int4_rows(message[src], width, block)
    return total


def quantized_reduce_scatter(segments: Sequence[torch.Tensor], out: torch.Tensor, intra: "RankGroup",
                             inter: "RankGroup", block: int, async_op: bool = False) -> Handle | None:
    """Sum `segments` over the intra x inter grid; this rank's shards land in `out`.

    See [Note: hierarchical quantized reduce-scatter]. Collective over both
    groups: every rank calls it with segments of the same sizes, in the
    same order.

    Args:
        segments: 1-D float tensors (any float dtype), segment i of W·w_i
            elements laid out rank-major: shard r is [r·w_i, (r+1)·w_i).
            Read before the first all-to-all is issued (they may be freed
            or overwritten once this returns).
        out: (sum of w_i,), any float dtype: receives the concatenation,
            over segments, of the sum over all ranks of shard r, where
            r = inter.rank * intra.size + intra.rank. May alias a segment.
        intra: this node's ranks (size L). inter: the ranks with this
            rank's local rank, one per node (size N).
        block: elements per int4 block (even); one fp32 scale each.
        async_op: return before the first all-to-all completes; the handle's
            `wait()` then decodes, runs the second stage and writes `out`.
            With one rank per node there is no first stage: everything
            runs before the call returns.

    Returns:
        A handle (async_op) or None.

    Raises:
        ValueError: a segment is not a multiple of W elements, `out` has
            the wrong size, or the block is odd (before any communication).
    """
    local, nodes = intra.size, inter.size
    world = local * nodes
    widths = []
    for seg in segments:
        if seg.dim() != 1 or seg.numel() % world:
            raise ValueError(f"a segment of {tuple(seg.shape)} cannot be cut into {world} equal shards")
        widths.append(seg.numel() // world)
    width = sum(widths)
    if out.numel() != width:
        raise ValueError(f"out has {out.numel()} elements, this rank's shards {width}")
    if block < 2 or block % 2:
        raise ValueError(f"int4 quantization block must be an even number >= 2 of elements, got {block}")
    rows = torch.empty(local, nodes, width, dtype=torch.float32, device=out.device)
    at = 0
    for seg, w in zip(segments, widths):  # rows[j, k] = shard k*L + j (step 0 of the note)
        rows[:, :, at:at + w] = seg.view(nodes, local, w).transpose(0, 1)
        at += w

    def across_nodes(node_sum: torch.Tensor) -> None:
        """Stage 2 from the node's sums (fp32 [N, width]) and the write into `out`."""
        if nodes > 1:
            send = pack_int4_rows(node_sum, block)
            received = torch.empty_like(send)
            all_to_all_single(received, send, group=inter.group)  # blocks: N rows of int4
            out.copy_(_sum_rows(received.unsqueeze(1), width, block).view(-1))
        else:
            out.copy_(node_sum.view(-1))

    if local == 1:
        across_nodes(rows[0])
        return CompletedWork() if async_op else None
    send = pack_int4_rows(rows.view(local * nodes, width), block).view(local, nodes, -1)
    del rows
    received = torch.empty_like(send)
    work = all_to_all_single(received, send, group=intra.group, async_op=True)

    def finish(buffers=(send, received)) -> None:  # holds `send` until the all-to-all is complete
        across_nodes(_sum_rows(buffers[1], width, block))
    handle = _ThenWork(work, finish)
    if not async_op:
        handle.wait()
        return None
    return handle

"""ZeRO++ qgZ (zero_quantized_gradients): stage-3 gradients reduced by a hierarchical int4 all-to-all."""
from __future__ import annotations

import os

import pytest
import torch

from dsrun.runtime.comm.quantized import (dequantize_int4, int4_row_bytes, pack_int4_rows, quantize_int4,
                                          unpack_int4_rows)
from tests.dist_helpers import run_ranks

BLOCK = 8


# ---- int4 blocks -------------------------------------------------------------------------------

def test_int4_nibbles_scales_and_rounding():
    x = torch.tensor([7.0, -7.0, 0.5, 1.5, 3.49, -0.5, 0.0, 2.0,  # block 0: scale 1
                      0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,  # block 1: all zeros
                      14.0, -1.0])  # block 2: scale 2, padded with zeros
    codes, scales = quantize_int4(x, 8)
    assert codes.dtype == torch.uint8 and codes.numel() == 12 and scales.tolist() == [1.0, 0.0, 2.0]
    q0 = [7, -7, 0, 2, 3, 0, 0, 2]  # round half to even: 0.5 -> 0, 1.5 -> 2, -0.5 -> 0
    assert codes[:4].tolist() == [(q0[2 * i] + 8) | ((q0[2 * i + 1] + 8) << 4) for i in range(4)]
    assert codes[4:8].tolist() == [0x88] * 4  # zeros: q = 0, stored as 8
    assert codes[8].item() == (7 + 8) | ((-0.0 + 8).__int__() << 4)  # 14/2 = 7, -1/2 = -0.5 -> -0 -> 8
    back = dequantize_int4(codes, scales)
    assert back[:8].tolist() == [7, -7, 0, 2, 3, 0, 0, 2] and (back[8:16] == 0).all()
    assert back[16:18].tolist() == [14.0, 0.0]


def test_int4_error_is_half_a_step_of_each_block():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(64, generator=gen) * 1e-4, torch.randn(70, generator=gen) * 30])
    codes, scales = quantize_int4(x, 64)
    back = dequantize_int4(codes, scales)[:x.numel()]
    for b in range(scales.numel()):
        lo, hi = b * 64, min((b + 1) * 64, x.numel())
        assert (back[lo:hi] - x[lo:hi]).abs().max() <= scales[b] / 2 * (1 + 1e-6)
    assert scales[0] < 1e-4  # small gradients get their own small step


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_int4_nonfinite_poisons_its_block_only(bad):
    x = torch.arange(24, dtype=torch.float32)
    x[10] = bad
    back = dequantize_int4(*quantize_int4(x, 8))
    assert back[8:16].isnan().all()  # never silently dropped: the whole block decodes to NaN
    assert torch.isfinite(back[:8]).all() and torch.isfinite(back[16:]).all()


def test_int4_rows_are_quantized_separately():
    rows = torch.tensor([[1.0, 2.0, 3.0], [100.0, -50.0, 7.0]])
    message = pack_int4_rows(rows, 4)
    assert message.shape == (2, int4_row_bytes(3, 4)) == (2, 2 + 4)
    back = unpack_int4_rows(message, 3, 4)
    assert back.shape == (2, 3)
    assert (back[0] - rows[0]).abs().max() <= 3 / 7 / 2 + 1e-6  # row 0's scale is its own, not row 1's
    with pytest.raises(ValueError, match="even"):
        quantize_int4(rows.view(-1), 3)


# ---- the collective against a plain reference ---------------------------------------------------

def _fake_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """What a row becomes after int4 and back, written plainly: per block
    s = max|x| / 7, q = round(x / s) in [-7, 7], x' = q * s (fp32)."""
    out = torch.empty(x.numel(), dtype=torch.float32)
    for lo in range(0, x.numel(), block):
        b = x[lo:lo + block].float()
        s = b.abs().max() / 7
        out[lo:lo + block] = torch.zeros_like(b) if s == 0 else (b / s).round().clamp(-7, 7) * s
    return out


def reference(inputs: list[list[torch.Tensor]], nodes: int, local: int, block: int) -> list[torch.Tensor]:
    """Every rank's result from every rank's segments, in one process: rank r
    = (node k, local j) gets, over nodes m in order, the int4 round trip of
    node m's sum (over its local ranks in order) of the int4 round trips of
    their shard r; a stage over one rank is skipped (no quantization)."""
    world = nodes * local
    results = []
    for r in range(world):
        shard = [torch.cat([seg.view(world, -1)[r] for seg in inputs[i]]).float() for i in range(world)]
        total = None
        for m in range(nodes):
            node = None
            for i in range(m * local, (m + 1) * local):
                part = _fake_quant(shard[i], block) if local > 1 else shard[i]
                node = part.clone() if node is None else node + part
            part = _fake_quant(node, block) if nodes > 1 else node
            total = part.clone() if total is None else total + part
        results.append(total)
    return results


def _inputs(world: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Per rank: three segments of 5, 8 and 1 elements per shard (a row of
    14: two blocks of 8, the second padded), mixed magnitudes."""
    out = []
    for rank in range(world):
        gen = torch.Generator().manual_seed(rank)
        out.append([(torch.randn(world * w, generator=gen) * scale).to(dtype)
                    for w, scale in ((5, 1.0), (8, 1e-3), (1, 50.0))])
    return out


def node_groups(nodes: int, local: int):
    """(intra, inter) RankGroups of this rank on a nodes x local grid (node-major ranks)."""
    import torch.distributed as dist
    from dsrun.runtime.zero.groups import RankGroup
    rank = dist.get_rank()
    intra = inter = None
    for k in range(nodes):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(k * local, (k + 1) * local)))
        if rank // local == k:
            intra = g
    for j in range(local):
        g = dist.new_group(list(range(j, nodes * local, local)))
        if rank % local == j:
            inter = g
    return RankGroup(intra, rank % local, local), RankGroup(inter, rank // local, nodes)


def _collective_rank(nodes: int, local: int, dtype: torch.dtype):
    import dsrun
    from dsrun.runtime.comm.hierarchical import quantized_reduce_scatter
    os.environ.update(LOCAL_WORLD_SIZE=str(local), LOCAL_RANK=str(int(os.environ["RANK"]) % local))
    dsrun.init_distributed()
    intra, inter = node_groups(nodes, local)
    segments = [s.clone() for s in _inputs(nodes * local, dtype)[dsrun.comm.get_rank()]]
    out = torch.empty(sum(s.numel() for s in segments) // (nodes * local), dtype=dtype)
    dsrun.comm.comms_logger.reset()
    handle = quantized_reduce_scatter(segments, out, intra, inter, BLOCK, async_op=True)
    handle.wait()
    stats = dsrun.comm.comms_logger.snapshot().get("all_to_all_single")
    return out, (stats.calls, stats.bytes) if stats else (0, 0)


@pytest.mark.parametrize("nodes,local", [(2, 2), (1, 2), (2, 1)])
def test_collective_equals_reference_bit_for_bit(nodes, local):
    world = nodes * local
    results = run_ranks(_collective_rank, world, nodes, local, torch.float32, timeout=120)
    expected = reference(_inputs(world, torch.float32), nodes, local, BLOCK)
    for r, (out, (calls, sent)) in enumerate(results):
        assert torch.equal(out, expected[r]), (r, out, expected[r])
        # int4 codes plus a 4-byte scale per block of every shard row: W rows, then N rows
        rows = int4_row_bytes(5 + 8 + 1, BLOCK)  # a rank's shards of all segments form one row
        assert calls == (local > 1) + (nodes > 1)
        assert sent == (world * rows if local > 1 else 0) + (nodes * rows if nodes > 1 else 0)
    # the quantization is real: the exact sum differs, by at most what int4 allows
    exact = [sum(torch.cat([seg.view(world, -1)[r] for seg in rank]) for rank in _inputs(world, torch.float32))
             for r in range(world)]
    assert any(not torch.equal(out, e) for (out, _), e in zip(results, exact))
    for (out, _), e in zip(results, exact):
        assert (out - e).abs().max() <= 0.2 * e.abs().max() * world


def test_collective_bf16_in_and_out():
    results = run_ranks(_collective_rank, 4, 2, 2, torch.bfloat16, timeout=120)
    expected = reference(_inputs(4, torch.bfloat16), 2, 2, BLOCK)
    for r, (out, _) in enumerate(results):
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected[r].to(torch.bfloat16))

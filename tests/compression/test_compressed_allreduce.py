"""The error-compensated 1-bit all-reduce (dsrun.runtime.comm.compressed) on real gloo ranks,
against the algorithm written out plainly in one process."""
from __future__ import annotations

import pytest
import torch

from dsrun.runtime.comm.compressed import (compressed_bus_bytes, pack_signs, padded_numel,
                                           server_chunk_numel, unpack_signs)
from tests.dist_helpers import run_ranks


def test_pack_signs_msb_first_and_round_trip():
    x = torch.tensor([1.0, -1, -2, -3, -4, -5, -6, 0.0])  # 0 counts as positive
    assert pack_signs(x).tolist() == [0b10000001]
    y = torch.randn(64)
    torch.testing.assert_close(unpack_signs(pack_signs(y)), torch.where(y >= 0, 1.0, -1.0))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(12))


def _one_bit(v: torch.Tensor, real: int) -> torch.Tensor:
    """scale·sign over the first `real` elements, scale = RMS of them; zeros on padding."""
    out = torch.zeros_like(v)
    if real:
        scale = v[:real].norm() / torch.tensor(float(real)).sqrt()
        out[:real] = torch.where(v[:real] >= 0, scale, -scale)
    return out


def reference_round(xs, worker_errors, server_errors):
    """One compressed all-reduce of p tensors, in a single process (updates the errors)."""
    p, n = len(xs), xs[0].numel()
    chunk = server_chunk_numel(n, p)
    real = [max(0, min(chunk, n - j * chunk)) for j in range(p)]
    compressed = []
    for i in range(p):
        y = torch.zeros(p * chunk)
        y[:n] = xs[i] + worker_errors[i]
        c = torch.cat([_one_bit(y[j * chunk:(j + 1) * chunk], real[j]) for j in range(p)])
        worker_errors[i] = (y - c)[:n]
        compressed.append(c)
    out = []
    for j in range(p):
        z = torch.stack([compressed[i][j * chunk:(j + 1) * chunk] / p for i in range(p)]).sum(0)
        z = z + server_errors[j]
        z[real[j]:] = 0
        s = _one_bit(z, real[j])
        server_errors[j] = z - s
        out.append(s)
    return torch.cat(out)[:n]


def _rank_rounds(n: int, rounds: int, seed: int):
    import dsrun
    from dsrun.runtime.comm.compressed import compressed_all_reduce
    dsrun.init_distributed()
    rank, world = dsrun.comm.get_rank(), dsrun.comm.get_world_size()
    gen = torch.Generator().manual_seed(seed + rank)
    we, se = torch.zeros(n), torch.zeros(server_chunk_numel(n, world))
    inputs, outputs = [], []
    for _ in range(rounds):
        x = torch.randn(n, generator=gen) * 0.1 + 0.05
        inputs.append(x.clone())
        outputs.append(compressed_all_reduce(x, we, se).clone())
    return inputs, outputs, we, se


@pytest.mark.parametrize("world, n", [(2, 1000), pytest.param(3, 37, marks=pytest.mark.slow)])
def test_matches_single_process_reference_bit_for_bit(world, n):
    results = run_ranks(_rank_rounds, world, n, 5, 0, timeout=120)
    for out in results[1:]:
        for a, b in zip(results[0][1], out[1]):
            assert torch.equal(a, b)  # every rank holds the same estimate
    we = [torch.zeros(n) for _ in range(world)]
    se = [torch.zeros(server_chunk_numel(n, world)) for _ in range(world)]
    for t in range(5):
        want = reference_round([r[0][t] for r in results], we, se)
        got = results[0][1][t]
        if world == 2:
            assert torch.equal(got, want), (got - want).abs().max()
        else:  # three terms summed in another order: the last bit may differ
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_error_feedback_makes_the_running_sum_track_the_true_sum():
    n, rounds = 4096, 40
    results = run_ranks(_rank_rounds, 2, n, rounds, 7, timeout=120)
    true = sum(sum(r[0][t] for r in results) / 2 for t in range(rounds))
    got = sum(results[0][1][t] for t in range(rounds))
    # Exact identity of error feedback: sum(out) = sum(mean) - mean(worker errors) - server errors.
    worker = (results[0][2] + results[1][2]) / 2
    server = torch.cat([results[0][3], results[1][3]])[:n]
    torch.testing.assert_close(got + worker + server, true, rtol=1e-4, atol=1e-4)
    # ... so the accumulated error stays bounded while the sums grow with the rounds:
    one_round = (results[0][1][0] - (results[0][0][0] + results[1][0][0]) / 2).norm()
    assert (got - true).norm() < 1.5 * one_round
    assert (got - true).norm() / true.norm() < 0.1


def _rank_bytes(n: int):
    import dsrun
    from dsrun.runtime.comm.compressed import compressed_all_reduce
    dsrun.init_distributed()
    world = dsrun.comm.get_world_size()
    log = dsrun.comm.comms_logger
    log.reset()
    dsrun.comm.all_reduce(torch.ones(n, dtype=torch.float16))
    fp16 = sum(s.bus_bytes for s in log.snapshot().values())
    log.reset()
    compressed_all_reduce(torch.ones(n), torch.zeros(n), torch.zeros(server_chunk_numel(n, world)))
    stats = log.snapshot()
    return fp16, sum(s.bus_bytes for s in stats.values()), sorted(stats)


def test_bytes_sixteen_times_fewer_than_fp16_all_reduce():
    n = 1 << 20
    fp16, compressed, ops = run_ranks(_rank_bytes, 2, n, timeout=120)[0]
    assert ops == ["all_gather_into_tensor", "all_to_all_single"]
    assert fp16 == 2 * n  # 2 bytes x 2(p-1)/p
    assert compressed == compressed_bus_bytes(n, 2) == n // 8 + 8
    # the sign bits are 1/16 of the fp16 bytes; the two 4-byte scales per phase come on top
    assert compressed - 8 == fp16 // 16
    assert fp16 / compressed > 15.99
    assert padded_numel(n, 2) == n

"""ZeRO++ qwZ (zero_quantized_weights): stage-3 weight all-gathers in block-wise int8."""
from __future__ import annotations

import pytest
import torch

from dsrun.runtime.comm.quantized import (dequantize_blockwise, message_numel, pack_message,
                                          quantize_blockwise, unpack_message)
from tests.dist_helpers import run_ranks
from tests.zero.models import base_config, train


def test_blockwise_int8_error_is_half_a_step_of_each_block():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(256, generator=gen) * 1e-3, torch.zeros(256), torch.randn(100, generator=gen) * 10])
    q, scales = quantize_blockwise(x, 256)
    assert q.dtype == torch.int8 and q.numel() == 768 and scales.numel() == 3  # last block padded
    back = dequantize_blockwise(q, scales)[:x.numel()]
    for b in range(3):
        lo, hi = b * 256, min((b + 1) * 256, x.numel())
        assert (back[lo:hi] - x[lo:hi]).abs().max() <= scales[b] / 2 * (1 + 1e-6)
    assert scales[1] == 0 and (back[256:512] == 0).all()  # a block of zeros stays exact
    assert scales[0] < 1e-4  # small weights get their own small step
    message = pack_message(x, 256)
    assert message.numel() == message_numel(x.numel(), 256) == 768 + 12
    torch.testing.assert_close(unpack_message(message, x.numel(), 256, torch.float32), back)


def _rank_pair(precision: str, steps: int):
    import dsrun
    zero = {"stage3_param_persistence_threshold": 0}  # every unit gathered in forward/backward
    out = {}
    for name, quantized in (("plain", False), ("qwz", True)):
        cfg = base_config(3, precision, world_size=2, zero_quantized_weights=quantized, **zero)
        dsrun.comm.comms_logger.reset()
        losses, full, engine = train(cfg, steps=steps, optimizer="config", lr=1e-2, model_kwargs={"d": 64})
        stats = dsrun.comm.comms_logger.snapshot()
        out[name] = (losses, full, {op: (s.calls, s.bytes) for op, s in stats.items()})
    return out


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_stage3_losses_close_to_plain_and_a_quarter_of_the_bytes(precision):
    steps = 8
    res = run_ranks(_rank_pair, 2, precision, steps, timeout=240)[0]
    plain, qwz = res["plain"], res["qwz"]
    # losses: int8 weights with a 256-element scale, relative error below 1% per weight
    for a, b in zip(plain[0], qwz[0]):
        assert abs(a - b) <= 0.02 * abs(a), (plain[0], qwz[0])
    assert plain[0][-1] < plain[0][0] and qwz[0][-1] < qwz[0][0]
    # the fp32 master weights end close to the plain run's (Adam may flip a near-zero gradient's sign)
    diff = sum(float((qwz[1][n] - plain[1][n]).norm() ** 2) for n in plain[1]) ** 0.5
    assert diff <= 0.02 * sum(float(plain[1][n].norm() ** 2) for n in plain[1]) ** 0.5
    gathered_plain = plain[2]["logical_all_gather"][1]
    sent_plain = sum(b for op, (_, b) in plain[2].items() if op in ("all_gather_into_tensor", "all_reduce"))
    int8_sent = qwz[2]["all_gather_into_tensor"][1]
    element = 4 if precision == "fp32" else 2
    # int8 + 4 bytes per 256 values, against the compute dtype's bytes of the same gathers
    assert int8_sent <= gathered_plain / element * (1 + 4 / 256) * 1.05  # some shards are padded to a block
    assert int8_sent < sent_plain


def test_quantized_weights_need_stage_3():
    from dsrun.runtime.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="need stage 3"):
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
                    world_size=1)

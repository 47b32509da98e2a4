"""Automatic tensor parallelism of a model built under zero.Init (see
dsrun/runtime/zero/tensor_parallel.py [Note: tensor parallelism of a
zero.Init model]), on 2 gloo ranks at tp=2 x dp=1:

- every parameter equals, bit for bit, the same parameter of the plain model
  built from the same seed and sharded by tp_model_init (HF GPT-2 with its
  Conv1D, fused q/k/v and tied output layer; Llama; the byte GPT);
- a byte GPT of ~190 MiB: the peak RSS of zero.Init construction plus
  tp_model_init stays at half the model plus a few of its largest
  parameters, below 3/4 of the model (the full weights never exist on a rank);
- ZeRO-3 training (tp_model_init, and config tensor_parallel.autotp_size)
  gives the losses of the plain model sharded the same way (rtol = atol =
  1e-6: the same arithmetic, summed in the same order).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.dist_helpers import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

MiB = 1 << 20


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=64, num_hidden_layers=2, vocab_size=64,
                                        max_position_embeddings=16))


def _byte_gpt(n_layer: int = 2, n_embd: int = 32):
    from gpt_model import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=n_layer, n_head=4, n_embd=n_embd, dropout=0.0))


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "gpt": _byte_gpt}


def _sharded(kind: str, under_init: bool, seed: int = 3):
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    set_current(None)
    torch.manual_seed(seed)
    if under_init:
        with dsrun.zero.Init():
            model = BUILDERS[kind]()
    else:
        model = BUILDERS[kind]()
    return dsrun.tp_model_init(model, 2, torch.float32)


def _values_equal() -> dict:
    """kind -> names of parameters differing from the plain model's slice
    (dp = 1: a parameter's data-axis shard is its whole slice)."""
    import dsrun
    dsrun.init_distributed()
    out = {}
    for kind in BUILDERS:
        plain = dict(_sharded(kind, False).named_parameters())
        model = _sharded(kind, True)
        wrong = []
        for name, p in model.named_parameters():
            want = plain[name].detach()
            if p.ds_tensor.numel() != want.numel():
                wrong.append(f"{name} shard {p.ds_tensor.numel()} {tuple(want.shape)}")
                continue
            got = p.ds_tensor[:want.numel()].view(want.shape)
            if p.numel() != 0 or p.ds_shape != want.shape or not torch.equal(got, want):
                wrong.append(name)
            if getattr(plain[name], "tp_split", None) != getattr(p, "tp_split", None):
                wrong.append(name + ".tp_split")
        out[kind] = wrong
    return out


def test_zero_init_slices_equal_the_plain_models():
    for rank, result in enumerate(run_ranks(_values_equal, 2, timeout=180)):
        assert result == {kind: [] for kind in BUILDERS}, f"rank {rank}: {result}"


def _peak() -> dict:
    import dsrun
    from dsrun.runtime.memory import profile as memory_profile
    dsrun.init_distributed()
    with memory_profile.phase("tp_init"):  # resets the kernel's peak RSS at its start
        torch.manual_seed(0)
        with dsrun.zero.Init():
            model = _byte_gpt(n_layer=16, n_embd=512)
        numels = [p.ds_numel for p in model.parameters()]  # the full model's
        dsrun.tp_model_init(model, 2)
    record = memory_profile.recorded_phases()["tp_init"]
    assert record["rss_peak_reset"], memory_profile.rss_source()
    kept = sum(p.ds_tensor.numel() for p in model.parameters())
    return {"peak": record["rss_peak"] - record["rss_start"], "model": 4 * sum(numels),
            "largest": 4 * max(numels), "kept": 4 * kept}


@pytest.mark.slow
def test_peak_memory_stays_below_the_full_model():
    for rank, r in enumerate(run_ranks(_peak, 2, timeout=300)):
        assert r["kept"] < 0.6 * r["model"]  # about half: the split weights halved, embeddings whole
        bound = r["kept"] + 4 * r["largest"] + 32 * MiB
        assert r["peak"] <= bound, (f"rank {rank}: peak {r['peak'] / MiB:.0f} MiB > {bound / MiB:.0f} MiB "
                                    f"(model {r['model'] / MiB:.0f} MiB)")
        assert r["peak"] < 0.75 * r["model"], (r["peak"] / MiB, r["model"] / MiB)


def _train(kind: str, under_init: bool, via_config: bool) -> list[float]:
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    set_current(None)
    if via_config:
        torch.manual_seed(3)
        with dsrun.zero.Init(enabled=under_init):
            model = BUILDERS[kind]()
    else:
        model = _sharded(kind, under_init)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.05,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if via_config:
        cfg["tensor_parallel"] = {"autotp_size": 2}
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(3):
        loss = engine(ids[:, :-1], ids[:, 1:]) if kind == "gpt" else engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.destroy()
    return losses


def _zero3_runs(kind: str, via_config: bool) -> tuple[list[float], list[float]]:
    import dsrun
    dsrun.init_distributed()
    return _train(kind, False, via_config), _train(kind, True, via_config)


@pytest.mark.parametrize("kind,via_config", [("llama", False), ("gpt", True)])
def test_zero3_training_at_tp2_equals_the_plain_model(kind, via_config):
    for rank, (want, got) in enumerate(run_ranks(_zero3_runs, 2, kind, via_config, timeout=240)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-6)
        assert got[-1] < got[0], f"rank {rank}: it does not train: {got}"

"""Vocabulary parallelism in automatic tensor parallelism
(tp_model_init(..., vocab_parallel=True), config
tensor_parallel.vocab_parallel; see dsrun/runtime/parallel/tensor/vocab.py),
on 2 gloo ranks at tp=2:

- logits equal the unsharded model's (rtol = atol = 1e-5, as
  test_autotp.py) for HF GPT-2 and the byte GPT (output layer tied to the
  embedding: still one parameter) and Llama (untied), also for GPT-2 built
  under zero.Init;
- training through the config key gives the losses and clipped gradient
  norms of the same model sharded without vocabulary parallelism
  (rtol = atol = 1e-5);
- a vocabulary the model axis does not divide, and the config key on a
  model sharded without it, are errors saying so.
"""
from __future__ import annotations

import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_tp_zero_init import BUILDERS

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _ids(seed: int, batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    out = model(ids)
    return (out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out).detach()


def _embedding_and_head(kind: str, model):
    if kind == "gpt":
        return model.tok_emb, model.head
    return model.get_input_embeddings(), model.lm_head


def _check_logits() -> dict:
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    from dsrun.runtime.parallel.tensor.layers import ColumnParallelLinear, VocabParallelEmbedding
    dsrun.init_distributed()
    out = {}
    for kind, under_init in [("gpt2", False), ("llama", False), ("gpt", False), ("gpt2", True)]:
        set_current(None)
        torch.manual_seed(1)
        want = _logits(BUILDERS[kind]().eval(), _ids(1))
        torch.manual_seed(1)
        with dsrun.zero.Init(enabled=under_init):
            model = BUILDERS[kind]()
        model = dsrun.tp_model_init(model, 2, torch.float32, vocab_parallel=True)
        emb, head = _embedding_and_head(kind, model)
        if under_init:  # dp = 1: each data-axis shard is the whole slice
            for p in model.parameters():
                p.data = p.ds_tensor[:p.ds_numel].view(p.ds_shape)
        got = _logits(model.eval(), _ids(1))
        torch.testing.assert_close(got, want, **TOL)
        out[f"{kind}{'-init' if under_init else ''}"] = (
            isinstance(emb, VocabParallelEmbedding), isinstance(head, ColumnParallelLinear),
            (head.weight is emb.weight) == (kind != "llama"), tuple(_full_rows(emb.weight)))
    return out


def _full_rows(weight) -> tuple[int, ...]:
    return tuple(getattr(weight, "ds_shape", None) or weight.shape)[:1]


def test_logits_equal_the_unsharded_model():
    for rank, result in enumerate(run_ranks(_check_logits, 2, timeout=180)):
        for label, (emb, head, tie, rows) in result.items():
            assert emb and head and tie, f"rank {rank} {label}: {result[label]}"
            assert rows == (32,), f"rank {rank} {label}: {rows}"  # 64 ids over 2 ranks


def _train(vocab_parallel: bool) -> tuple[list[float], list[float]]:
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    set_current(None)
    torch.manual_seed(3)
    model = BUILDERS["gpt2"]()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.05,
           "zero_optimization": {"stage": 1},
           "tensor_parallel": {"autotp_size": 2, "vocab_parallel": vocab_parallel}}
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    ids = _ids(5, batch=4, seq=9)
    losses, norms = [], []
    for _ in range(3):
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return losses, norms


def _runs():
    import dsrun
    dsrun.init_distributed()
    return _train(False), _train(True)


def test_training_through_the_config_key_equals_the_replicated_vocabulary():
    for rank, ((want_loss, want_norm), (got_loss, got_norm)) in enumerate(run_ranks(_runs, 2, timeout=240)):
        torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), **TOL)
        torch.testing.assert_close(torch.tensor(got_norm), torch.tensor(want_norm), **TOL)
        assert got_loss[-1] < got_loss[0], f"rank {rank}: it does not train: {got_loss}"


def _errors() -> list[str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    dsrun.init_distributed()
    messages = []
    odd = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=63, n_positions=16))
    try:
        dsrun.tp_model_init(odd, 2, vocab_parallel=True)
    except ValueError as exc:
        messages.append(str(exc))
    messages.append(str(hasattr(odd, "ds_autotp_parsed")))  # refused before anything changed
    set_current(None)
    model = dsrun.tp_model_init(BUILDERS["gpt2"](), 2)
    try:
        dsrun.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                              "tensor_parallel": {"vocab_parallel": True}})
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_refusals_say_what_to_change():
    odd, changed, config = run_ranks(_errors, 2, timeout=120)[0]
    assert "'transformer.wte' has 63 rows, not divisible by the tensor-parallel size 2" in odd
    assert changed == "False"
    assert "tensor_parallel.vocab_parallel=true but the model was sharded without it" in config

"""Ulysses with a Hugging Face model: a tiny Llama (grouped-query
attention, `sdpa`) built from a config, wrapped by wrap_hf_attention, fed
by UlyssesSPDataLoaderAdapter and trained by the engine, against the same
model unsharded on one process: logits, the engine's token-averaged loss
(sequence ranks counting different numbers of tokens), parameters after
SGD steps (so the gradients), with ZeRO 1-3, bf16, and data x sequence.
Also initialize(mesh_param=...) and the batch slicing on its own."""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks

pytest.importorskip("transformers")

VOCAB, LENGTH, STEPS, LR = 32, 7, 3, 0.5  # 7 tokens: not a multiple of 2, so the batches are padded
TOL = {"rtol": 2e-5, "atol": 2e-5}


def _model(kind: str = "llama"):
    """A tiny Llama (rotary positions, 4 query and 2 key/value heads) or
    GPT-2 (learned positions, tied head), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=16, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          attn_implementation="sdpa"))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _samples(count: int) -> dict[str, torch.Tensor]:
    """`count` right-padded samples whose labels count different numbers of
    tokens in the two halves (prompt tokens and padding are -100)."""
    ids = torch.randint(0, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([7, 5, 5, 4][:count])
    prompt = torch.tensor([3, 0, 1, 2][:count])
    place = torch.arange(LENGTH)[None, :]
    mask = (place < lengths[:, None]).long()
    labels = torch.where((place >= prompt[:, None]) & mask.bool(), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _reference(count: int, kind: str = "llama", steps: int = STEPS):
    """The unsharded model on all `count` samples at once, SGD: the losses,
    the first logits and the parameters after `steps` steps."""
    model = _model(kind)
    batch = _samples(count)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, logits = [], None
    for _ in range(steps):
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        logits = out.logits.detach() if logits is None else logits
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses, logits, torch.cat([p.detach().flatten() for p in model.parameters()])


def _train(stage: int, bf16: bool, data: int, sequence: int, kind: str = "llama"):
    """Ulysses training of the tiny Llama; data rank d takes samples
    [d * 2, d * 2 + 2) as one micro-batch. Returns the losses (the engine's
    token mean), this rank's first logits and the parameters after."""
    import dsrun
    from dsrun.runtime.parallel.mesh import current, set_current
    from dsrun.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter, wrap_hf_attention

    set_current(None)
    model = _model(kind)
    config = {"train_batch_size": 2 * data, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": bf16}, "gradient_clipping": 0.0, "steps_per_print": 1000}
    engine, *_ = dsrun.initialize(model=model, config=config, mesh_param=(data, sequence))
    mesh = current()
    assert (mesh.size("data"), mesh.size("sequence")) == (data, sequence)
    wrap_hf_attention(model)
    everything = _samples(2 * data)
    mine = {k: v[2 * mesh.rank("data"): 2 * mesh.rank("data") + 2] for k, v in everything.items()}
    loader = UlyssesSPDataLoaderAdapter([mine] * STEPS, mesh.rank("sequence"), mesh.group("sequence"),
                                        sequence, shared_samples=True)
    losses, logits = [], None
    for batch in loader:
        out = engine(**batch)
        logits = out.logits.detach().float() if logits is None else logits
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    with dsrun.zero.GatheredParameters(list(engine.module.parameters())):
        params = torch.cat([p.detach().float().flatten().clone() for p in engine.module.parameters()])
    engine.destroy()
    return losses, logits, params


def _cases(cases):
    import dsrun
    dsrun.init_distributed()
    return [_train(*case) for case in cases]


def _check(results, reference, data: int, sequence: int, cases, tol) -> None:
    want_losses, want_logits, want_params = reference
    chunk = -(-LENGTH // sequence)
    for rank, per_case in enumerate(results):
        data_rank, sequence_rank = divmod(rank, sequence)
        for case, (losses, logits, params) in zip(cases, per_case):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **tol, msg=str(case))
            torch.testing.assert_close(params, want_params, **tol, msg=str(case))
            start = sequence_rank * chunk
            real = max(0, min(chunk, LENGTH - start))  # the padded positions have no reference
            torch.testing.assert_close(logits[:, :real],
                                       want_logits[2 * data_rank: 2 * data_rank + 2, start:start + real],
                                       **tol, msg=str(case))


def test_hf_sequence_2_equals_unsharded_with_zero_1_2_3():
    """sequence=2 x data=1 (mesh_param=(1, 2)), ZeRO 1, 2 and 3: logits of
    each rank's tokens, losses and parameters after 3 SGD steps equal the
    unsharded model's on the same 2 samples, whose halves count 6 and 2
    tokens: the engine averages the loss over tokens, not ranks. GPT-2
    (learned positions) at ZeRO-2 too."""
    cases = [(1, False, 1, 2), (2, False, 1, 2), (3, False, 1, 2), (2, False, 1, 2, "gpt2")]
    results = run_ranks(_cases, 2, cases, timeout=300)
    for kind in ("llama", "gpt2"):
        reference = _reference(2, kind)
        assert reference[0][-1] < reference[0][0]  # it trains
        chosen = [i for i, case in enumerate(cases) if (case[4:] or ("llama",))[0] == kind]
        _check([[per_case[i] for i in chosen] for per_case in results], reference, 1, 2,
               [cases[i] for i in chosen], TOL)


def test_hf_llama_bf16_follows_fp32():
    """bf16 at ZeRO-2 with sequence=2: the losses follow the fp32 unsharded
    run within bf16's rounding (3 significant digits)."""
    results = run_ranks(_cases, 2, [(2, True, 1, 2)], timeout=240)
    want = _reference(2)[0]
    for per_case in results:
        torch.testing.assert_close(torch.tensor(per_case[0][0]), torch.tensor(want), rtol=2e-2, atol=2e-2)


def test_hf_llama_zero3_sequence_2_x_data_2_equals_unsharded():
    """4 ranks, ZeRO-3, sequence=2 x data=2: the token mean over the 4
    samples of both data ranks, as the unsharded model on all 4. The
    second half of data rank 1's samples counts no token (its loss is 0/0;
    its gradient must still reach ZeRO-3's hooks)."""
    cases = [(3, False, 2, 2)]
    results = run_ranks(_cases, 4, cases, timeout=300)
    _check(results, _reference(4), 2, 2, cases, TOL)


# -- the batch slicing ------------------------------------------------------------

def test_shard_batch_shifts_pads_and_slices():
    from dsrun.runtime.sequence_parallel.ulysses_sp import shard_batch
    batch = _samples(2)
    halves = [shard_batch(batch, r, 2) for r in range(2)]
    assert set(halves[0]) == {"input_ids", "labels", "shift_labels", "position_ids"}
    whole = {k: torch.cat([h[k] for h in halves], dim=1) for k in halves[0]}
    assert whole["input_ids"].shape == (2, 8)  # padded to a multiple of 2
    torch.testing.assert_close(whole["input_ids"][:, :LENGTH], batch["input_ids"])
    torch.testing.assert_close(whole["position_ids"], torch.arange(8).expand(2, 8))
    want = torch.full((2, 8), -100)
    want[:, :LENGTH - 1] = batch["labels"][:, 1:]
    torch.testing.assert_close(whole["shift_labels"], want)
    torch.testing.assert_close(whole["labels"], want)
    assert [int((h["shift_labels"] != -100).sum()) for h in halves] == [6, 2]  # the halves count differently
    with pytest.raises(ValueError, match="only right padding"):
        shard_batch({**batch, "attention_mask": batch["attention_mask"].flip(1)}, 0, 2)
    with pytest.raises(ValueError, match="has no 'labels'"):
        shard_batch({"input_ids": batch["input_ids"]}, 0, 2)
    with pytest.raises(ValueError, match="every tensor must be"):
        shard_batch({**batch, "extra": torch.zeros(2, 3)}, 0, 2)


def _adapter_exchanges():
    import dsrun
    from dsrun.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter, shard_batch
    dsrun.init_distributed()
    rank = dsrun.comm.get_rank()
    batches = [{k: v[rank:rank + 1] for k, v in _samples(2).items()}]  # each rank its own sample
    adapter = UlyssesSPDataLoaderAdapter(batches, rank, None, 2)
    got = list(adapter)
    assert len(adapter) == len(got) == 2  # one micro-batch per rank's batch, in rank order
    for source, mine in enumerate(got):
        want = shard_batch({k: v[source:source + 1] for k, v in _samples(2).items()}, rank, 2)
        for key in want:
            torch.testing.assert_close(mine[key], want[key])


def test_adapter_gathers_each_ranks_batch():
    """DeepSpeed's mode: rank r's loader yields sample r; every rank gets
    its slice of sample 0, then of sample 1."""
    run_ranks(_adapter_exchanges, 2, timeout=60)


def test_mesh_param_is_checked():
    from dsrun.runtime.config import ConfigError
    from dsrun.runtime.engine.compose import _sequence_size
    model = torch.nn.Linear(2, 2)
    assert _sequence_size(model, {}, 4, (2, 2)) == 2
    assert _sequence_size(model, {"sequence_parallel_size": 2}, 4, (2, 2)) == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size is 4; remove one"):
        _sequence_size(model, {"sequence_parallel_size": 4}, 4, (2, 2))
    with pytest.raises(ConfigError, match="but the job has 4"):
        _sequence_size(model, {}, 4, (1, 2))
    with pytest.raises(ConfigError, match="two integers >= 1"):
        _sequence_size(model, {}, 4, 2)

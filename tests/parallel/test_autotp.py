"""Automatic tensor parallelism (dsrun.tp_model_init, config
"tensor_parallel.autotp_size") and tensor x data (x pipeline) training, on
real gloo ranks: a tiny Hugging Face GPT-2 and Llama built from their
configs (no download), a Mistral likewise, and examples/gpt_model.py's GPT give the unsharded
logits at tp=2 (and tp=4 with Llama's 2 key/value heads replicated);
training losses at tp=2 x dp=2 equal dp=4; pp=2 x tp=2 x dp=2 with
Megatron layers equals the data-parallel run; a layer AutoTP cannot place is
named in the error.

Tolerances: fp32 except one bf16 run (rtol 2e-2). Logits: rtol = atol = 1e-5 (the sharded model
sums its matmuls in another order). Training losses: rtol = atol = 1e-5 over
4 AdamW steps (lr 1e-2), the same order of rounding compounding through
a few updates.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.dist_helpers import run_ranks, train_steps

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


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                        num_hidden_layers=2, vocab_size=64, max_position_embeddings=16)
    return MistralForCausalLM(cfg)


def _byte_gpt():
    from gpt_model import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0))


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "gpt": _byte_gpt}


def _build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[kind]()


def _ids(seed: int, batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    out = model(ids)
    return (out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out).detach()


def _check_logits(kind: str, tp: int) -> None:
    """Each rank builds its model from another seed; tp_model_init shards
    rank 0's (it broadcasts the full model first), so the logits are those
    of the unsharded model built from rank 0's seed."""
    import dsrun
    dsrun.init_distributed()
    want = _logits(_build(kind, seed=1).eval(), _ids(1))
    model = dsrun.tp_model_init(_build(kind, seed=1 + torch.distributed.get_rank()), tp, torch.float32)
    torch.testing.assert_close(_logits(model.eval(), _ids(1)), want, **TOL)
    heads, kv = 4 // tp, max(2 // tp, 1)  # this rank's query heads; Llama/Mistral key/value heads
    if kind == "gpt2":
        attn = model.transformer.h[0].attn
        assert (attn.num_heads, attn.split_size) == (heads, heads * 8)
    elif kind == "gpt":
        assert model.blocks[0].attn.n_head == heads
    else:
        attn = model.model.layers[0].self_attn
        assert attn.num_key_value_groups == heads // kv
        assert attn.k_proj.weight.shape == (kv * 8, 32)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral", "gpt"])
def test_logits_equal_unsharded_at_tp2(kind):
    run_ranks(_check_logits, 2, kind, 2, timeout=120)


def test_logits_equal_unsharded_llama_tp4_replicated_kv():
    """4 ranks, 2 key/value heads: each head kept whole by 2 ranks."""
    run_ranks(_check_logits, 4, "llama", 4, timeout=120)


def _config(stage: int, micro: int, autotp: int = 1, bf16: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "gradient_clipping": 0.05,  # below the gradient norm: clipping (and its norm) matters
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if autotp > 1:
        cfg["tensor_parallel"] = {"autotp_size": autotp}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _lm_loss(kind: str, model, ids):
    if kind == "gpt":
        return model(ids[:, :-1], ids[:, 1:])
    return model(ids, labels=ids).loss


def _train(kind: str, stage: int, tp: int, via_config: bool, bf16: bool) -> tuple[list[float], list[float]]:
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
    engine, *_ = dsrun.initialize(model=model, config=_config(stage, micro, tp if via_config else 1, bf16))
    data_rank = rank // tp  # data x model mesh: the model axis is innermost
    batch = _ids(100, batch=8)[data_rank * micro:(data_rank + 1) * micro]
    out = train_steps(engine, STEPS, lambda _: _lm_loss(kind, engine, batch))
    engine.destroy()
    return out


def _tp_vs_dp(kind: str, stage: int, tp: int, via_config: bool, bf16: bool = False):
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    dsrun.init_distributed()
    want = _train(kind, stage, 1, False, bf16)
    set_current(None)
    got = _train(kind, stage, tp, via_config, bf16)
    return want, got


@pytest.mark.parametrize("kind,stage,tp,via_config", [("gpt2", 1, 2, False), ("llama", 2, 2, True),
                                                       ("gpt", 0, 2, False), ("llama", 1, 4, False),
                                                       ("llama", 3, 4, True)])
def test_training_tp_x_dp_equals_dp(kind, stage, tp, via_config):
    """tp x dp (4 ranks) against dp=4 on the same samples: losses and the
    clipped global gradient norm each step (tp=4: Llama's 2 key/value heads
    replicated, their gradients summed)."""
    results = run_ranks(_tp_vs_dp, 4, kind, stage, tp, via_config, timeout=240)
    (want_loss, want_norm), (got_loss, got_norm) = results[0]
    torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), **TOL)
    torch.testing.assert_close(torch.tensor(got_norm), torch.tensor(want_norm), **TOL)
    assert want_loss[-1] < want_loss[0]  # it trains


def test_training_tp_x_dp_bf16_close_to_dp():
    """bf16 (ZeRO-2): the same within bf16's rounding (rtol 2e-2: the sharded
    matmuls round their partial sums to bf16 before the all-reduce)."""
    (want_loss, want_norm), (got_loss, got_norm) = run_ranks(_tp_vs_dp, 4, "gpt2", 2, 2, False, True,
                                                              timeout=240)[0]
    torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), rtol=2e-2, atol=0)
    torch.testing.assert_close(torch.tensor(got_norm), torch.tensor(want_norm), rtol=2e-2, atol=0)
    assert want_loss[-1] < want_loss[0]


# -- pipeline x tensor x data ------------------------------------------------------------------
HIDDEN, MICRO_SAMPLES, GAS = 8, 8, 2  # samples per micro-step over all data ranks


class _TPBlock(torch.nn.Module):
    """x + Row(tanh(Column(LayerNorm(x)))): Megatron's MLP block, (B, H) -> (B, H)."""

    def __init__(self, hidden: int) -> None:
        from dsrun.runtime.parallel.tensor import ColumnParallelLinear, RowParallelLinear
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = ColumnParallelLinear(hidden, 4 * hidden)
        self.down = RowParallelLinear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _train_3d(pipe: int, model: int) -> tuple[list[float], list[float]]:
    """STEPS train_batch calls of a 4-block PipelineModule (with a replicated
    linear layer tied between the first and the last stage, and a replicated
    output layer) on the pipe x model x data mesh of 8 ranks, ZeRO-1."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    mesh = ParallelMesh.build(dist.get_world_size(), pipe=pipe, model=model)
    set_current(mesh)  # the layers take their model group from the current mesh
    tied = TiedLayerSpec("io", torch.nn.Linear, HIDDEN, HIDDEN, bias=False)
    layers = [tied] + [LayerSpec(_TPBlock, HIDDEN) for _ in range(4)] + [tied, LayerSpec(torch.nn.Linear, HIDDEN, 2)]
    module = PipelineModule(layers, loss_fn=F.mse_loss, topology=mesh.topology, seed_layers=True,
                            partition_method="uniform")
    dp = mesh.size("data")
    micro = MICRO_SAMPLES // dp
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.05,
           "zero_optimization": {"stage": 1}, "steps_per_print": 1000}
    engine, *_ = dsrun.initialize(model=module, config=cfg)
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(GAS * MICRO_SAMPLES, HIDDEN, generator=gen)
    ys = torch.randn(GAS * MICRO_SAMPLES, 2, generator=gen)
    d = mesh.rank("data")
    batches = [(xs[k * MICRO_SAMPLES + d * micro:k * MICRO_SAMPLES + (d + 1) * micro],
                ys[k * MICRO_SAMPLES + d * micro:k * MICRO_SAMPLES + (d + 1) * micro]) for k in range(GAS)]
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(float(engine.train_batch(iter(batches))))
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return losses, norms


def _3d_vs_dp():
    import dsrun
    dsrun.init_distributed()
    return _train_3d(1, 1), _train_3d(2, 2)


def test_pipe_x_tensor_x_data_equals_data_parallel():
    """pp=2 x tp=2 x dp=2 against dp=8, same layers and seeds (ZeRO-1): the
    losses and clipped norms of every step, on every rank (the tied layer's
    groups span each (data, model) coordinate; its copy on the last stage
    counts once in the norm)."""
    results = run_ranks(_3d_vs_dp, 8, timeout=300)
    for (want_loss, want_norm), (got_loss, got_norm) in results:
        torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), **TOL)
        torch.testing.assert_close(torch.tensor(got_norm), torch.tensor(want_norm), **TOL)
    assert results[0][0][0][-1] < results[0][0][0][0]


# -- sequence parallelism: partial gradients summed before the step ---------------------------
SEQ = 8


class _SPBlock(torch.nn.Module):
    """Megatron's MLP block with sequence parallelism, (s/tp, b, H) -> (s/tp, b, H):
    the LayerNorm sees this rank's tokens only (its parameters are marked
    sequence_parallel, as is the row layer's bias)."""

    def __init__(self, hidden: int) -> None:
        from dsrun.runtime.parallel.tensor import ColumnParallelLinear, RowParallelLinear
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        for p in self.norm.parameters():
            p.sequence_parallel = True
        self.up = ColumnParallelLinear(hidden, 4 * hidden, sequence_parallel=True)
        self.down = RowParallelLinear(4 * hidden, hidden, sequence_parallel=True)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class _SPModel(torch.nn.Module):
    """x (s, b, H), y (s, b, 2) -> MSE loss; two sequence-parallel blocks and a replicated head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_SPBlock(HIDDEN) for _ in range(2))
        self.head = torch.nn.Linear(HIDDEN, 2)

    def forward(self, x, y):
        import torch.nn.functional as F

        from dsrun.runtime.parallel.mesh import current
        from dsrun.runtime.parallel.tensor.mappings import gather_from_sequence_region, scatter_to_sequence_region
        group = current().axis_group("model")
        x = scatter_to_sequence_region(x, group)
        for block in self.blocks:
            x = block(x)
        x = gather_from_sequence_region(x, group, reduce_grads=False)
        return F.mse_loss(self.head(x), y)


def _train_sp(model_ranks: int) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    import dsrun
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    set_current(ParallelMesh.build(dist.get_world_size(), model=model_ranks))
    torch.manual_seed(0)
    model = _SPModel()
    dp = dist.get_world_size() // model_ranks
    micro = 4 // dp
    engine, *_ = dsrun.initialize(model=model, config=_config(2, micro))
    gen = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(SEQ, 4, HIDDEN, generator=gen), torch.randn(SEQ, 4, 2, generator=gen)
    d = dist.get_rank() // model_ranks
    x, y = xs[:, d * micro:(d + 1) * micro], ys[:, d * micro:(d + 1) * micro]
    out = train_steps(engine, STEPS, lambda _: engine(x, y))
    engine.destroy()
    return out


def _sp_vs_dp():
    import dsrun
    dsrun.init_distributed()
    return _train_sp(1), _train_sp(2)


def test_sequence_parallel_tp_x_dp_equals_dp():
    """A hand-built sequence-parallel model at tp=2 x dp=2 (ZeRO-2) against
    dp=4: the LayerNorm and row-bias gradients are summed over the model
    group before the step (Engine pre-step hook), so losses and norms match."""
    (want_loss, want_norm), (got_loss, got_norm) = run_ranks(_sp_vs_dp, 4, timeout=240)[0]
    torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), **TOL)
    torch.testing.assert_close(torch.tensor(got_norm), torch.tensor(want_norm), **TOL)


# -- errors --------------------------------------------------------------------------------------
class _Unplaceable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.fc = torch.nn.Linear(8, 16)
        self.mlp.router = torch.nn.Linear(16, 8)  # no rule names it

    def forward(self, x):
        return self.mlp.router(self.mlp.fc(x))


def _check_unplaceable() -> str:
    import dsrun
    dsrun.init_distributed()
    model = _Unplaceable()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'mlp\.router'") as info:
        dsrun.tp_model_init(model, 2)
    assert isinstance(model.mlp.fc, torch.nn.Linear)  # nothing replaced: the plan is checked first
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return str(info.value)


def test_unplaceable_layer_is_named():
    message = run_ranks(_check_unplaceable, 2, timeout=120)[0]
    assert "cannot place layer 'mlp.router' (Linear)" in message


def _check_config_errors() -> list[str]:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule
    from dsrun.runtime.config import ConfigError
    dsrun.init_distributed()
    messages = []
    pipe = PipelineModule([LayerSpec(torch.nn.Linear, 4, 4) for _ in range(2)], num_stages=2, loss_fn=F.mse_loss)
    with pytest.raises(ConfigError) as info:
        dsrun.initialize(model=pipe, config=_config(1, 1, autotp=2))
    messages.append(str(info.value))
    vocab = _config(1, 1, autotp=2)
    vocab["tensor_parallel"]["vocab_parallel"] = True
    with pytest.raises(ConfigError) as info:
        dsrun.initialize(model=pipe, config=vocab)
    messages.append(str(info.value))
    model = dsrun.tp_model_init(_build("gpt"), 2)
    with pytest.raises(ConfigError) as info:
        dsrun.initialize(model=model, config=_config(1, 1, autotp=4))
    messages.append(str(info.value))
    from dsrun.runtime.parallel.tensor import ColumnParallelLinear  # on the current mesh: model axis 2
    megatron = PipelineModule([ColumnParallelLinear(4, 8, gather_output=True)], num_stages=1, loss_fn=F.mse_loss)
    with pytest.raises(ConfigError) as info:  # no topology, no declaration: the mesh would drop the model axis
        dsrun.initialize(model=megatron, config=_config(1, 1))
    messages.append(str(info.value))
    return messages


def test_config_conflicts_are_errors():
    """autotp_size with a PipelineModule whose layers no rule places or with
    vocab_parallel, an autotp_size other than the degree tp_model_init
    used, and a PipelineModule of tensor-parallel layers whose degrees lack
    the model axis stop initialize with a ConfigError."""
    pipe, vocab, mismatch, dropped = run_ranks(_check_config_errors, 2, timeout=120)[0]
    assert "tensor_parallel.autotp_size=2: tensor parallelism cannot place layer" in pipe
    assert "tensor_parallel.vocab_parallel=true with a PipelineModule" in vocab
    assert "tensor_parallel.autotp_size=4 but the model is already sharded over 2 ranks" in mismatch
    assert "holds tensor-parallel layers (built on a model axis of 2 ranks) but its degrees have no tensor" in dropped

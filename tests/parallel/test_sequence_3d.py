"""Sequence, tensor and pipeline parallelism together, each combination
against one process training the same model on the same global batch (loss
and global gradient norm per step, fp32, 1e-5; clipping active):

- tensor 2 x sequence 2 (ZeRO-2): AutoTP splits the heads over the tensor
  ranks, Ulysses the local heads over the sequence ranks;
- pipe 2 x sequence 2 (ZeRO-1): Ulysses inside each stage, the token-mean
  loss at the last stage over the sequence ranks;
- pipe 2 x tensor 2 (ZeRO-1): `tensor_parallel.autotp_size` shards each
  stage's layers by name.

The model is a tiny Llama-like LM (q_proj/k_proj/v_proj/o_proj, a SwiGLU
MLP of gate_proj/up_proj/down_proj, grouped-query attention through
DistributedAttention on `groups._get_sequence_parallel_group()`), built
after `init_distributed(config=...)` as a DeepSpeed script would. 4 gloo
ranks; the 8-rank runs (pipe 2 x tensor 2 x sequence 2, and tensor 2 x
sequence 2 x data 2 at ZeRO-2) are marked slow."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_helpers import run_ranks

TOL = {"rtol": 1e-5, "atol": 1e-5}
VOCAB, WIDTH, HEADS, KV_HEADS, N, STEPS = 16, 16, 4, 2, 8, 3
SAMPLES, MICRO = 4, 2  # global batch of 4 samples: 2 micro-batches of 2 per data rank
CLIP = 0.5             # below the steps' gradient norms, so clipping is active


def _seeded(seed: int):
    torch.manual_seed(seed)


class Embed(torch.nn.Module):
    """Token and learned position embeddings; positions are the tokens'
    places in the whole sequence (this sequence rank's slice)."""

    def __init__(self, seed: int):
        super().__init__()
        _seeded(seed)
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.positions = torch.nn.Embedding(N, WIDTH)

    def forward(self, ids):
        from dsrun.utils import groups
        n = ids.shape[1]
        start = groups._get_sequence_parallel_rank() * n
        return self.tokens(ids) + self.positions(torch.arange(start, start + n))


def _causal_attention(q, k, v):
    """Causal grouped-query attention on [b, s, h, d] for the whole sequence."""
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


class Attention(torch.nn.Module):
    """Llama-style attention; the head counts are read from the projections'
    widths (AutoTP leaves each rank its heads' rows)."""

    def __init__(self):
        super().__init__()
        from dsrun.sequence.layer import DistributedAttention
        from dsrun.utils import groups
        self.num_heads, self.num_key_value_heads, self.head_dim = HEADS, KV_HEADS, WIDTH // HEADS
        self.q_proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.k_proj = torch.nn.Linear(WIDTH, KV_HEADS * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(WIDTH, KV_HEADS * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        sequence = groups._get_sequence_parallel_world_size()
        self.attention = (DistributedAttention(_causal_attention, groups._get_sequence_parallel_group())
                          if sequence > 1 else _causal_attention)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b, n, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(self.attention(q, k, v).reshape(b, n, -1))


class Block(torch.nn.Module):
    """Pre-norm transformer block: attention, then a SwiGLU MLP."""

    def __init__(self, seed: int):
        super().__init__()
        _seeded(seed)
        self.input_norm = torch.nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.post_norm = torch.nn.LayerNorm(WIDTH)
        self.gate_proj = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.up_proj = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down_proj = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(self.input_norm(x))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Head(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        _seeded(seed)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.lm_head(self.norm(x))


LAYERS = ((Embed, 1), (Block, 2), (Block, 3), (Head, 4))


def token_mean_loss(logits, labels):
    """The token mean of the cross-entropy over the whole sequence group."""
    from dsrun.sequence import sequence_parallel_loss
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return sequence_parallel_loss(per_token.view_as(labels))


def _batches(sequence: int, data: int, data_rank: int) -> list:
    """This rank's micro-batches of each step: (ids, labels) of its data
    rank's samples, its sequence rank's slice of the tokens."""
    from dsrun.sequence import shard_sequence
    tokens = torch.randint(0, VOCAB, (SAMPLES, N + 1), generator=torch.Generator().manual_seed(7))
    per_rank = SAMPLES // data
    out = []
    for _ in range(STEPS):  # the same batch each step: the loss must fall
        mine = tokens[data_rank * per_rank:(data_rank + 1) * per_rank]
        for micro in range(0, per_rank, MICRO):
            ids, labels = mine[micro:micro + MICRO, :-1], mine[micro:micro + MICRO, 1:]
            if sequence > 1:
                ids, labels = shard_sequence(ids, 1), shard_sequence(labels, 1)
            out.append((ids, labels))
    return out


def _train(pipe: int = 1, tensor: int = 1, sequence: int = 1, stage: int = 1) -> list[tuple[float, float]]:
    """STEPS steps of the model on `pipe x tensor x sequence` ranks (data
    parallelism takes the rest); returns (loss, global gradient norm) per step."""
    import torch.distributed as dist

    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule
    from dsrun.utils import groups
    cfg = {"train_batch_size": SAMPLES, "train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000,
           "pipeline": {"stages": pipe}, "tensor_parallel": {"autotp_size": tensor},
           "sequence_parallel_size": sequence}
    dsrun.init_distributed(config=cfg)  # the mesh first: the attention takes its sequence group
    data = groups._get_data_parallel_world_size()
    batches = _batches(sequence, data, groups._get_data_parallel_rank())
    if pipe > 1:
        model = PipelineModule([LayerSpec(cls, seed) for cls, seed in LAYERS], num_stages=pipe,
                               loss_fn=token_mean_loss, partition_method="uniform")
    else:
        model = torch.nn.Sequential(*(cls(seed) for cls, seed in LAYERS))
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    assert (groups._get_sequence_parallel_world_size(), groups.get_tensor_model_parallel_world_size()) == \
        (sequence, tensor)
    queries = [m for name, m in engine.module.named_modules() if name.endswith("q_proj")]
    assert queries and all(q.weight.shape[0] == WIDTH // tensor for q in queries)  # this rank's heads only
    assert engine.gradient_accumulation_steps() == SAMPLES // MICRO // data
    out, loader = [], iter(batches)
    for _ in range(STEPS):
        if pipe > 1:
            loss = float(engine.train_batch(loader))
        else:
            loss = 0.0
            for _ in range(engine.gradient_accumulation_steps()):
                ids, labels = next(loader)
                micro_loss = token_mean_loss(engine(ids), labels)
                engine.backward(micro_loss)
                engine.step()
                loss += float(micro_loss.detach()) / engine.gradient_accumulation_steps()
            if data > 1:  # the data ranks train on different samples: the step's loss is their mean
                total = torch.tensor(loss)
                dist.all_reduce(total, group=groups._get_data_parallel_group())
                loss = float(total) / data
        out.append((loss, float(engine.get_global_grad_norm())))
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def one_process():
    want = run_ranks(_train, 1, timeout=120)[0]
    assert min(norm for _, norm in want) > CLIP  # clipping acts on every step
    assert want[-1][0] < want[0][0]  # it trains
    return torch.tensor(want)


def _check(results, want) -> None:
    for got in results:  # every rank reports the step's loss and the global norm
        torch.testing.assert_close(torch.tensor(got), want, **TOL)


def test_tensor_x_sequence_equals_one_process(one_process):
    """tensor 2 x sequence 2, ZeRO-2: heads over the tensor ranks, then the
    local heads over the sequence ranks."""
    _check(run_ranks(_train, 4, 1, 2, 2, 2, timeout=240), one_process)


def test_pipeline_x_sequence_equals_one_process(one_process):
    """pipe 2 x sequence 2, ZeRO-1: Ulysses inside each stage."""
    _check(run_ranks(_train, 4, 2, 1, 2, 1, timeout=240), one_process)


def test_autotp_pipeline_equals_one_process(one_process):
    """pipe 2 x tensor 2 from tensor_parallel.autotp_size, ZeRO-1: each
    stage's q/k/v/o and MLP projections sharded by name."""
    _check(run_ranks(_train, 4, 2, 2, 1, 1, timeout=240), one_process)


@pytest.mark.slow
def test_pipeline_x_tensor_x_sequence_equals_one_process(one_process):
    """pipe 2 x tensor 2 x sequence 2 on 8 ranks, ZeRO-1."""
    _check(run_ranks(_train, 8, 2, 2, 2, 1, timeout=480), one_process)


@pytest.mark.slow
def test_tensor_x_sequence_x_data_equals_one_process(one_process):
    """tensor 2 x sequence 2 x data 2 on 8 ranks, ZeRO-2 over data x sequence."""
    _check(run_ranks(_train, 8, 1, 2, 2, 2, timeout=480), one_process)

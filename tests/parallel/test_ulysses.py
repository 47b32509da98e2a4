"""Ulysses sequence parallelism: DistributedAttention against unsharded
attention (values and gradients, GQA, both layouts, head counts the ranks
do not divide, all-to-all counts and bytes), the token-averaged loss,
refusals of sizes it cannot split, training at sequence=2 x data=2 with
ZeRO-2 against data=4, and 6 heads at sequence=4 against one process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsrun.ops import shm_comm
from tests.dist_helpers import run_ranks

TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32: the sharded and whole computations sum in different orders
EXACT = {"rtol": 1e-6, "atol": 1e-6}  # attention alone: the exchanges copy, each head is computed as in the whole
B, N, D = 2, 8, 4                 # batch, whole sequence, head_dim


def _data(seed: int, *shape: int) -> torch.Tensor:
    """The same random tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _sdpa(q, k, v, batch_dim_idx=0, causal=True):
    """Grouped-query causal attention on [b, s, h, d] (or [s, b, h, d])."""
    if batch_dim_idx == 1:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal).transpose(1, 2)
    return out.transpose(0, 1) if batch_dim_idx == 1 else out


def _calls(op: str) -> tuple[int, int]:
    from dsrun.runtime.comm import comms_logger
    stats = comms_logger.snapshot().get(op)
    return (stats.calls, stats.bytes) if stats else (0, 0)


def _check_attention(heads: int, kv_heads: int, batch_dim_idx: int, kv_sent: int) -> None:
    """`kv_sent`: the key/value heads all destinations together receive from
    a rank (a head whose query heads straddle two ranks goes to both)."""
    import dsrun
    from dsrun.runtime.comm import comms_logger
    from dsrun.runtime.parallel.mesh import ParallelMesh
    from dsrun.sequence import shard_sequence
    from dsrun.sequence.layer import DistributedAttention

    dsrun.init_distributed()
    world = dsrun.comm.get_world_size()
    mesh = ParallelMesh.build(world, sequence=world)
    seq_dim = 1 - batch_dim_idx

    def layout(*shape):  # [b, s, ...] -> the tested layout
        t = _data(*shape)
        return t.transpose(0, 1).contiguous() if batch_dim_idx == 1 else t

    q, k, v = layout(1, B, N, heads, D), layout(2, B, N, kv_heads, D), layout(3, B, N, kv_heads, D)
    grad_out = layout(4, B, N, heads, D)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    _sdpa(*whole, batch_dim_idx).backward(grad_out)
    want = _sdpa(*whole, batch_dim_idx).detach()

    mine = [shard_sequence(t, seq_dim, mesh.axis_group("sequence")).clone().requires_grad_() for t in (q, k, v)]
    attention = DistributedAttention(lambda a, b, c: _sdpa(a, b, c, batch_dim_idx),
                                     mesh.group("sequence"), scatter_idx=2, gather_idx=0)
    comms_logger.reset()
    out = attention(*mine, batch_dim_idx)
    scattered = B * (N // world) * (heads + 2 * kv_sent) * D  # this rank's tokens of every head, to their ranks
    my_heads = heads // world + (dsrun.comm.get_rank() < heads % world)  # the first h % P ranks take one head more
    gathered = B * N * my_heads * D  # the whole sequence of this rank's heads, back to the tokens' ranks
    calls = _calls("all_to_all_single")
    assert calls == (1 + 1, (scattered + gathered) * 4), calls
    # The sequence group is on this node: both exchanges (uneven ones too) go over shared memory.
    transport = "shm" if shm_comm.available() else "torch"
    assert comms_logger.snapshot()["all_to_all_single"].transports == {transport: 2}
    torch.testing.assert_close(out, shard_sequence(want, seq_dim, mesh.group("sequence")), **EXACT)
    comms_logger.reset()
    out.backward(shard_sequence(grad_out, seq_dim, mesh.group("sequence")))
    assert _calls("all_to_all_single")[0] == 2  # one for the output's gradient, one for dq, dk, dv
    for name, got, ref in zip("qkv", mine, whole):
        torch.testing.assert_close(got.grad, shard_sequence(ref.grad, seq_dim, mesh.group("sequence")),
                                   **EXACT, msg=f"d{name}")


def _check_attentions(cases) -> None:
    for case in cases:
        _check_attention(*case)


@pytest.mark.parametrize("world,cases", [(2, [(4, 2, 0, 2), (4, 4, 1, 4)]),
                                         (4, [(8, 2, 0, 4), (4, 1, 1, 4), (12, 6, 0, 8)])])
def test_distributed_attention_equals_whole_attention(world, cases):
    """Output and q/k/v gradients at P=2 and 4, both layouts, GQA with more
    and with fewer key/value heads than ranks, and with 6 key/value heads on
    4 ranks (3 query heads a rank using key/value heads 0 0 1: repeated to
    one per query head); one all-to-all each way. (Several cases per run:
    starting ranks costs more than a case.)"""
    run_ranks(_check_attentions, world, cases, timeout=120)


def test_heads_the_ranks_do_not_divide_equal_whole_attention():
    """6 query heads on 4 ranks (2, 2, 1, 1 heads), alone and with 3 and 2
    key/value heads (neither dividing nor divided by 4: a key/value head
    goes to every rank whose query heads use it), both layouts: output and
    gradients equal whole attention, bytes as counted per head sent."""
    run_ranks(_check_attentions, 4, [(6, 6, 0, 6), (6, 3, 1, 4), (6, 2, 0, 5), (5, 1, 0, 4)], timeout=120)


def test_twelve_heads_on_eight_ranks_equal_whole_attention():
    """12 query heads on 8 ranks (2 heads on ranks 0-3, 1 on 4-7), alone and
    with 4 key/value heads."""
    run_ranks(_check_attentions, 8, [(12, 12, 0, 12), (12, 4, 1, 9)], timeout=240)


def test_head_plan():
    """Which heads each rank takes: the first h % P ranks one more, the
    key/value heads their query heads use; refusals name the numbers."""
    from dsrun.runtime.parallel.sequence.heads import plan_heads
    plan = plan_heads(6, 2, 4)
    assert plan.query == ((0, 2), (2, 4), (4, 5), (5, 6))
    assert plan.kv == ((0, 1), (0, 2), (1, 2), (1, 2))  # query heads 2, 3 use key/value heads 0, 1
    assert plan.kv_index == (None,) * 4
    assert plan_heads(12, 6, 4).kv_index == ((0, 0, 1), (0, 1, 1), (0, 0, 1), (0, 1, 1))
    assert plan_heads(8, 8, 4).query == ((0, 2), (2, 4), (4, 6), (6, 8))
    with pytest.raises(ValueError, match="3 query heads over 4 sequence-parallel ranks.*at most 3"):
        plan_heads(3, 3, 4)
    with pytest.raises(ValueError, match="6 query heads and 4 key/value heads"):
        plan_heads(6, 4, 4)


def _check_refusals() -> None:
    import dsrun
    from dsrun.runtime.parallel.mesh import ParallelMesh
    from dsrun.sequence import DistributedAttention, shard_sequence

    dsrun.init_distributed()
    mesh = ParallelMesh.build(dsrun.comm.get_world_size(), sequence=2)
    attention = DistributedAttention(_sdpa, mesh.axis_group("sequence"))
    n = N // 2
    with pytest.raises(ValueError, match="1 query head over 2 sequence-parallel ranks: every rank needs"):
        attention(_data(1, B, n, 1, D), _data(2, B, n, 1, D), _data(3, B, n, 1, D), 0)
    with pytest.raises(ValueError, match="6 query heads and 4 key/value heads"):
        attention(_data(1, B, n, 6, D), _data(2, B, n, 4, D), _data(3, B, n, 4, D), 0)
    with pytest.raises(ValueError, match="must agree on batch and sequence"):
        attention(_data(1, B, n, 4, D), _data(2, B, n + 1, 4, D), _data(3, B, n + 1, 4, D), 0)
    with pytest.raises(ValueError, match="batch_dim_idx=2"):
        attention(_data(1, B, n, 4, D), _data(2, B, n, 4, D), _data(3, B, n, 4, D), 2)
    with pytest.raises(ValueError, match="7 tokens cannot be split evenly over the 2"):
        shard_sequence(_data(1, B, 7), 1, mesh.axis_group("sequence"))


def test_bad_sizes_are_refused():
    """Heads, key/value heads, shapes and sequence lengths Ulysses cannot
    split stop with a message, before any communication."""
    run_ranks(_check_refusals, 2, timeout=60)
    from dsrun.sequence import DistributedAttention
    with pytest.raises(ValueError, match="scatter_idx must be 2"):
        DistributedAttention(_sdpa, None, scatter_idx=1)


def test_sequence_parallel_size_must_divide_the_job():
    from dsrun.runtime.config import ConfigError
    from dsrun.runtime.engine.compose import _sequence_size
    model = torch.nn.Linear(2, 2)
    assert _sequence_size(model, {"sequence_parallel_size": 2}, 4) == 2
    with pytest.raises(ConfigError, match="does not divide the 6 ranks"):
        _sequence_size(model, {"sequence_parallel_size": 4}, 6)
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        _sequence_size(model, {"sequence_parallel_size": 0}, 4)


def test_loss_without_sequence_parallelism_is_the_masked_mean():
    from dsrun.sequence.loss import sequence_parallel_loss
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1]])
    value = sequence_parallel_loss(loss, mask)
    value.backward()
    assert float(value.detach()) == pytest.approx(7 / 3)
    torch.testing.assert_close(loss.grad, torch.tensor([[1.0, 1.0, 0.0, 1.0]]) / 3)
    with pytest.raises(ValueError, match="counts no token"):
        sequence_parallel_loss(loss, torch.zeros_like(mask))


# -- training: sequence=2 x data=2 (ZeRO-2) against data=4 ----------------

VOCAB, HEADS, KV_HEADS, STEPS = 16, 4, 2, 3  # width: heads x D
ADAM = {"type": "Adam", "params": {"lr": 1e-2}}
# Adam turns rounding noise in a gradient element near zero into visible
# parameter differences; SGD passes gradient differences on unamplified
SGD = {"type": "SGD", "params": {"lr": 0.5}}
LENGTHS = (8, 5, 7, 3)  # valid tokens of the 4 samples: the two halves of a sample count differently


class _Block(torch.nn.Module):
    """A tiny causal GQA transformer LM; `attention` is the plain local one
    or DistributedAttention around it. Positions are the tokens' places in
    the whole sequence."""

    def __init__(self, sequence_group=None, heads: int = HEADS, kv_heads: int = KV_HEADS):
        super().__init__()
        from dsrun.sequence.layer import DistributedAttention
        self.heads, self.kv_heads, width = heads, kv_heads, heads * D
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Embedding(N, width)
        self.q = torch.nn.Linear(width, width)
        # no bias: a key bias has zero gradient in exact arithmetic, which Adam
        # would turn into rounding noise of full step size
        self.kv = torch.nn.Linear(width, 2 * kv_heads * D, bias=False)
        self.out = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB)
        self.attention = (DistributedAttention(_sdpa, sequence_group) if sequence_group is not None
                          else _sdpa)

    def forward(self, ids, positions):
        x = self.embed(ids) + self.position(positions)
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, D)
        k, v = self.kv(x).view(b, n, 2 * self.kv_heads, D).chunk(2, dim=2)
        x = x + self.out(self.attention(q, k, v, 0).flatten(2))
        return self.head(self.norm(x))


def _samples():
    ids = torch.randint(0, VOCAB, (4, N + 1), generator=torch.Generator().manual_seed(5))
    mask = (torch.arange(N)[None, :] < torch.tensor(LENGTHS)[:, None])
    return ids[:, :-1], ids[:, 1:], mask


def _train(sequence: int, stage: int = 2, heads: int = HEADS, kv_heads: int = KV_HEADS,
           optimizer: dict = ADAM, mics: int = -1, declared: bool = False,
           zero: dict | None = None) -> tuple[list[float], torch.Tensor]:
    """STEPS steps on the 4 samples. data=4: one sample per rank. sequence=2
    x data=2: data rank d takes samples 2d and 2d+1 as two micro-batches of
    one (gradient accumulation 2), each sequence rank its half of the
    tokens. `mics`: zero_optimization.mics_shard_size. `declared`: the mesh
    comes from dsrun.init_distributed(config=...) instead of set_current.
    `zero`: further zero_optimization settings.
    Returns the mean loss of the 4 samples per step and the parameters
    after training."""
    import torch.distributed as dist

    import dsrun
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    from dsrun.sequence import sequence_parallel_loss, shard_sequence
    from dsrun.utils import groups
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": sequence,
           "optimizer": optimizer, "zero_optimization": {"stage": stage, "mics_shard_size": mics, **(zero or {})},
           "gradient_clipping": 0.0, "steps_per_print": 1000}
    if declared:  # the mesh first, so that the model's DistributedAttention has its group
        dsrun.init_distributed(config=cfg)
    world = dist.get_world_size()
    data = world // sequence
    if sequence > 1 and not declared:
        set_current(ParallelMesh.build(world, sequence=sequence))
    torch.manual_seed(0)
    model = _Block(groups._get_sequence_parallel_group() if sequence > 1 else None, heads, kv_heads)
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    assert engine.gradient_accumulation_steps() == 4 // data
    assert groups._get_sequence_parallel_world_size() == sequence
    assert groups._get_sequence_data_parallel_world_size() == world  # ZeRO's group: data x sequence
    inputs, labels, mask = _samples()
    positions = torch.arange(N)[None, :]
    data_rank = dist.get_rank() // sequence  # axes data, sequence: sequence innermost
    losses = []
    for _ in range(STEPS):
        total = torch.zeros(())
        for micro in range(4 // data):
            sample = slice(data_rank * (4 // data) + micro, data_rank * (4 // data) + micro + 1)
            ids, lab, msk, pos = inputs[sample], labels[sample], mask[sample], positions
            if sequence > 1:
                ids, lab, msk, pos = (shard_sequence(t, 1) for t in (ids, lab, msk, pos))
            per_token = F.cross_entropy(engine(ids, pos).flatten(0, 1), lab.flatten(), reduction="none")
            loss = sequence_parallel_loss(per_token.view_as(lab), msk)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)  # sequence ranks hold the same loss: divide by them too
        losses.append(float(total) / (4 // data) / world)
    with dsrun.zero.GatheredParameters(list(engine.module.parameters())):  # ZeRO-3 holds shards
        params = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
    engine.destroy()
    return losses, params


def _sequence_vs_data():
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    dsrun.init_distributed()
    want = _train(1)
    set_current(None)
    got = _train(2)
    got3 = _train(2, stage=3)
    return want, got, got3


def test_training_sequence_x_data_equals_data_parallel():
    """sequence=2 x data=2 with ZeRO-2 (and ZeRO-3) gives data=4's losses and parameters
    (fp32, 1e-5) on padded samples whose sequence halves count different
    numbers of tokens: the loss is averaged over tokens, not ranks."""
    results = run_ranks(_sequence_vs_data, 4, timeout=180)
    (want_loss, want_params), (got_loss, got_params), (got3_loss, got3_params) = results[0]
    torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), **TOL)
    torch.testing.assert_close(got_params, want_params, **TOL)
    torch.testing.assert_close(torch.tensor(got3_loss), torch.tensor(want_loss), **TOL)  # ZeRO-3 too
    torch.testing.assert_close(got3_params, want_params, **TOL)
    assert want_loss[-1] < want_loss[0]  # it trains
    for _, (_, params), _ in results[1:]:  # every rank holds the same parameters
        torch.testing.assert_close(params, got_params, rtol=0, atol=0)


def _train_cases(sequence: int, cases) -> list[tuple[list[float], torch.Tensor]]:
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    dsrun.init_distributed()
    results = []
    for heads, kv_heads in cases:
        set_current(None)
        results.append(_train(sequence, 2, heads, kv_heads, SGD))
    return results


def test_training_six_heads_on_sequence_4_equals_one_process():
    """6 query heads at sequence=4 (ranks take 2, 2, 1, 1 heads), with 6 and
    with 2 key/value heads, ZeRO-2: every rank's losses per step and
    parameters after 3 SGD steps equal one process training the same model
    on the same samples (fp32, 1e-5)."""
    cases = [(6, 6), (6, 2)]
    want = run_ranks(_train_cases, 1, 1, cases, timeout=120)[0]
    got = run_ranks(_train_cases, 4, 4, cases, timeout=180)
    for case, (want_loss, want_params) in zip(cases, want):
        assert want_loss[-1] < want_loss[0], case  # it trains
    for rank, per_case in enumerate(got):
        for case, (loss, params), (want_loss, want_params) in zip(cases, per_case, want):
            torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), **TOL, msg=f"{case} rank {rank}")
            torch.testing.assert_close(params, want_params, **TOL, msg=f"{case} rank {rank}")

def _initialize_builds_the_mesh():
    import dsrun
    from dsrun.utils import groups
    torch.manual_seed(dsrun.comm.get_rank() if dsrun.comm.is_initialized() else 0)  # different weights per rank
    model = torch.nn.Linear(4, 4)
    engine, *_ = dsrun.initialize(model=model, config={
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}})
    sizes = (groups._get_sequence_parallel_world_size(), groups._get_sequence_data_parallel_world_size(),
             groups._get_data_parallel_world_size(), engine.gradient_accumulation_steps())
    weight = engine.module.weight.detach().clone()
    engine.destroy()
    return sizes, weight


def test_initialize_builds_the_sequence_axis():
    """sequence_parallel_size 2 on 2 ranks: one data rank (so 2 micro-batches
    of 1 make the batch of 2), ZeRO's group spans both, rank 0's weights."""
    (sizes, weight), (other_sizes, other_weight) = run_ranks(_initialize_builds_the_mesh, 2, timeout=60)
    assert sizes == other_sizes == (2, 2, 1, 2)
    torch.testing.assert_close(weight, other_weight, rtol=0, atol=0)


def test_token_weighted_mean_and_the_engine_hook_on_one_rank():
    """Without a group the token mean is the rank's own mean; a model's loss
    is replaced only when the forward had shift_labels; a rank counting no
    token needs a tensor to carry its zero gradient."""
    from types import SimpleNamespace

    from dsrun.runtime.parallel.sequence.loss import token_weighted_mean
    from dsrun.runtime.parallel.sequence.model_loss import token_mean_of_model_loss
    mean = torch.tensor(2.5, requires_grad=True)
    value = token_weighted_mean(mean, 4, None)
    value.backward()
    assert float(value.detach()) == 2.5 and float(mean.grad) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no fallback tensor"):
        token_weighted_mean(torch.tensor(float("nan")), 0, None)
    with pytest.raises(ValueError, match="no rank of the group counts a token"):
        token_weighted_mean(torch.tensor(float("nan")), 0, None, fallback=torch.ones(2, requires_grad=True))
    labels = torch.tensor([[1, -100, 2]])
    loss = torch.tensor(1.5, requires_grad=True)
    output = SimpleNamespace(loss=loss, logits=None)
    assert token_mean_of_model_loss(output, (), {"labels": labels}, None).loss is loss  # no shift_labels: untouched
    replaced = token_mean_of_model_loss(output, ({"shift_labels": labels},), {}, None).loss
    assert replaced is not loss and float(replaced.detach()) == 1.5

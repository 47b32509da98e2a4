"""Tensor-parallel layers on real gloo ranks (model axis = the whole job, 2
and 4 ranks) against the unsharded torch layers built from the same seed:
outputs, input gradients and each rank's shard of the weight gradients;
a column -> row MLP, its sequence-parallel variant, the vocabulary-parallel
embedding and cross-entropy; the bytes the comms logger counts; and
`dsrun.utils.groups` answering tensor-parallel questions from the mesh."""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks

B, S, H = 2, 4, 8          # batch, sequence, hidden: S and 4H divide by 4 ranks
VOCAB = 16
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _shard(full: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    return full.chunk(parts, dim=dim)[rank]


def _data(seed: int, *shape: int) -> torch.Tensor:
    """The same random tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _bytes(op: str) -> tuple[int, int]:
    """(calls, bytes) of `op` since the last reset."""
    from dsrun.runtime.comm import comms_logger
    stats = comms_logger.snapshot().get(op)
    return (stats.calls, stats.bytes) if stats else (0, 0)


def _check_groups(world: int, tp: int) -> None:
    """`dsrun.utils.groups` answers from the current mesh (model innermost:
    global rank g is model rank g % tp, with ranks g - g % tp ... + tp - 1)."""
    import torch.distributed as dist

    from dsrun.utils import groups
    me = dist.get_rank()
    assert groups.get_tensor_model_parallel_world_size() == tp
    assert groups.get_tensor_model_parallel_rank() == me % tp
    assert groups.get_model_parallel_world_size() == tp  # DeepSpeed's public name: tensor parallelism
    members = torch.zeros(world)
    members[me] = 1
    dist.all_reduce(members, group=groups.get_tensor_model_parallel_group())
    first = me - me % tp
    assert members.nonzero().view(-1).tolist() == list(range(first, first + tp))
    assert groups._get_data_parallel_world_size() == world // tp


def _check_column(rank: int, tp: int) -> None:
    from dsrun.runtime.parallel.tensor import ColumnParallelLinear
    for gather in (False, True):
        torch.manual_seed(1)
        ref = torch.nn.Linear(H, 4 * H)
        torch.manual_seed(1)
        layer = ColumnParallelLinear(H, 4 * H, gather_output=gather)
        x, x_ref = _data(2, B, S, H).requires_grad_(), _data(2, B, S, H).requires_grad_()
        grad_out = _data(3, B, S, 4 * H)
        out_ref = ref(x_ref)
        out_ref.backward(grad_out)
        out = layer(x)
        if gather:
            _close(out, out_ref, "column gathered output")
            out.backward(grad_out)
        else:
            _close(out, _shard(out_ref, -1, rank, tp), "column output shard")
            out.backward(_shard(grad_out, -1, rank, tp))
        _close(x.grad, x_ref.grad, "column input grad")
        _close(layer.weight.grad, _shard(ref.weight.grad, 0, rank, tp), "column weight grad")
        _close(layer.bias.grad, _shard(ref.bias.grad, 0, rank, tp), "column bias grad")


def _check_row(rank: int, tp: int) -> None:
    from dsrun.runtime.parallel.tensor import RowParallelLinear
    for parallel_input in (True, False):
        torch.manual_seed(4)
        ref = torch.nn.Linear(4 * H, H)
        torch.manual_seed(4)
        layer = RowParallelLinear(4 * H, H, input_is_parallel=parallel_input)
        full = _data(5, B, S, 4 * H)
        x = (_shard(full, -1, rank, tp) if parallel_input else full).clone().requires_grad_()
        x_ref = full.clone().requires_grad_()
        grad_out = _data(6, B, S, H)
        ref(x_ref).backward(grad_out)
        out = layer(x)
        _close(out, ref(x_ref), "row output")
        out.backward(grad_out)
        want = _shard(x_ref.grad, -1, rank, tp) if parallel_input else x_ref.grad
        _close(x.grad, want, "row input grad")
        _close(layer.weight.grad, _shard(ref.weight.grad, 1, rank, tp), "row weight grad")
        _close(layer.bias.grad, ref.bias.grad, "row bias grad")


def _check_embedding(rank: int, tp: int) -> None:
    from dsrun.runtime.parallel.tensor import VocabParallelEmbedding
    torch.manual_seed(7)
    ref = torch.nn.Embedding(VOCAB, H)
    torch.manual_seed(7)
    layer = VocabParallelEmbedding(VOCAB, H)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(8))
    grad_out = _data(9, B, S, H)
    out_ref = ref(ids)
    out_ref.backward(grad_out)
    out = layer(ids)
    _close(out, out_ref, "embedding output")
    out.backward(grad_out)
    _close(layer.weight.grad, _shard(ref.weight.grad, 0, rank, tp), "embedding weight grad")
    torch.manual_seed(7)
    layer = VocabParallelEmbedding(VOCAB, H, sequence_parallel=True)  # ids (s, b): split along dim 0
    out = layer(ids.T)
    _close(out, _shard(out_ref.transpose(0, 1), 0, rank, tp), "sequence-parallel embedding output")
    out.backward(_shard(grad_out.transpose(0, 1), 0, rank, tp))
    _close(layer.weight.grad, _shard(ref.weight.grad, 0, rank, tp), "sequence-parallel embedding weight grad")


class _MLP(torch.nn.Module):
    """Column (H -> 4H), GeLU, row (4H -> H): Megatron's MLP block."""

    def __init__(self, sequence_parallel: bool = False) -> None:
        super().__init__()
        from dsrun.runtime.parallel.tensor import ColumnParallelLinear, RowParallelLinear
        torch.manual_seed(10)
        self.up = ColumnParallelLinear(H, 4 * H, sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear(4 * H, H, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _check_mlp(rank: int, tp: int) -> None:
    """The MLP against the unsharded one, and the bytes of its two
    all-reduces: b*s*h fp32 each, one in forward and one in backward."""
    from dsrun.runtime.comm import comms_logger
    torch.manual_seed(10)
    ref = torch.nn.Sequential(torch.nn.Linear(H, 4 * H), torch.nn.GELU(), torch.nn.Linear(4 * H, H))
    mlp = _MLP()
    x, x_ref = _data(11, S, B, H).requires_grad_(), _data(11, S, B, H).requires_grad_()
    grad_out = _data(12, S, B, H)
    ref(x_ref).backward(grad_out)
    comms_logger.reset()
    out = mlp(x)
    assert _bytes("all_reduce") == (1, B * S * H * 4), _bytes("all_reduce")
    _close(out, ref(x_ref), "mlp output")
    comms_logger.reset()
    out.backward(grad_out)
    assert _bytes("all_reduce") == (1, B * S * H * 4), _bytes("all_reduce")
    _close(x.grad, x_ref.grad, "mlp input grad")
    _close(mlp.up.weight.grad, _shard(ref[0].weight.grad, 0, rank, tp), "mlp up weight grad")
    _close(mlp.down.weight.grad, _shard(ref[2].weight.grad, 1, rank, tp), "mlp down weight grad")
    _close(mlp.down.bias.grad, ref[2].bias.grad, "mlp down bias grad")


def _check_sequence_parallel(rank: int, tp: int) -> None:
    """The sequence-parallel MLP (input and output split along the sequence,
    dim 0 of (s, b, h)) equals the tensor-parallel one; its all-gather and
    reduce-scatter each move b*s*h fp32, as the all-reduce they replace."""
    from dsrun.runtime.comm import comms_logger
    from dsrun.runtime.parallel.mesh import current
    from dsrun.runtime.parallel.tensor import allreduce_sequence_parallel_grads
    from dsrun.runtime.parallel.tensor.mappings import scatter_to_sequence_region
    plain, sp = _MLP(), _MLP(sequence_parallel=True)
    x, x_sp = _data(13, S, B, H).requires_grad_(), _data(13, S, B, H).requires_grad_()
    grad_out = _data(14, S, B, H)
    plain(x).backward(grad_out)
    comms_logger.reset()
    out = sp(scatter_to_sequence_region(x_sp, current().axis_group("model")))
    assert _bytes("all_gather_into_tensor") == (1, B * S * H * 4), _bytes("all_gather_into_tensor")
    assert _bytes("reduce_scatter_tensor") == (1, B * S * H * 4), _bytes("reduce_scatter_tensor")
    assert _bytes("all_reduce") == (0, 0)
    _close(out, _shard(plain(x), 0, rank, tp), "sequence-parallel output")
    out.backward(_shard(grad_out, 0, rank, tp))
    assert allreduce_sequence_parallel_grads(sp) == 1  # the row layer's bias
    _close(x_sp.grad, x.grad, "sequence-parallel input grad")
    for (name, p), q in zip(sp.named_parameters(), plain.parameters()):
        _close(p.grad, q.grad, f"sequence-parallel grad of {name}")


def _check_sequence_dim(rank: int, tp: int) -> None:
    """The sequence mappings along dim 1 of a (b, s, h) tensor: the gather
    concatenates the ranks' tokens, the reduce-scatter keeps this rank's
    tokens of the sum, and each one's backward is the other."""
    from dsrun.runtime.parallel.mesh import current
    from dsrun.runtime.parallel.tensor.mappings import (gather_from_sequence_region,
                                                        reduce_scatter_to_sequence_region)
    group = current().axis_group("model")
    full = _data(17, B, S, H)
    mine = _shard(full, 1, rank, tp).clone().requires_grad_()
    gathered = gather_from_sequence_region(mine, group, dim=1, reduce_grads=False)
    _close(gathered, full, "sequence gather along dim 1")
    gathered.backward(full * 2)
    _close(mine.grad, _shard(full * 2, 1, rank, tp), "sequence gather backward (slice)")
    partial = (full * (rank + 1)).requires_grad_()
    scattered = reduce_scatter_to_sequence_region(partial, group, dim=1)
    total = sum(range(1, tp + 1))
    _close(scattered, _shard(full * total, 1, rank, tp), "sequence reduce-scatter along dim 1")
    scattered.backward(_shard(full, 1, rank, tp))
    _close(partial.grad, full, "sequence reduce-scatter backward (all-gather)")


def _check_cross_entropy(rank: int, tp: int) -> None:
    """Loss and logits grad equal F.cross_entropy on the full logits (one
    target ignored); two all-reduces of b*s and 2*b*s floats."""
    from dsrun.runtime.comm import comms_logger
    from dsrun.runtime.parallel.tensor import vocab_parallel_cross_entropy
    logits = _data(15, B, S, VOCAB) * 3
    target = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(16))
    target[0, 1] = -100
    full = logits.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(full.view(-1, VOCAB), target.view(-1), reduction="none")
    want.sum().backward()
    shard = _shard(logits, -1, rank, tp).clone().requires_grad_()
    comms_logger.reset()
    loss = vocab_parallel_cross_entropy(shard, target)
    assert _bytes("all_reduce") == (2, 3 * B * S * 4), _bytes("all_reduce")
    _close(loss.view(-1), want, "cross-entropy loss")
    loss.sum().backward()
    _close(shard.grad, _shard(full.grad, -1, rank, tp), "cross-entropy logits grad")
    with pytest.raises(ValueError, match="target has shape"):
        vocab_parallel_cross_entropy(shard, target[:, :1])


def _check_errors(tp: int) -> None:
    from dsrun.runtime.parallel.tensor import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding)
    odd = 2 * tp + 1
    with pytest.raises(ValueError, match=f"out_features = {odd} is not divisible by the tensor-parallel size"):
        ColumnParallelLinear(H, odd)
    with pytest.raises(ValueError, match=f"in_features = {odd} is not divisible"):
        RowParallelLinear(odd, H)
    with pytest.raises(ValueError, match=f"num_embeddings = {odd} is not divisible"):
        VocabParallelEmbedding(odd, H)
    with pytest.raises(ValueError, match="needs input_is_parallel=True"):
        RowParallelLinear(4 * H, H, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match="last dimension is 3"):
        ColumnParallelLinear(H, 4 * H)(torch.zeros(2, 3))


def _tensor_parallel_body(world: int) -> bool:
    """Every check with the model axis over the whole job; with 4 ranks, the
    MLP, sequence parallelism and cross-entropy again on model = 2 x data =
    2 (model groups that are subgroups of the job)."""
    import torch.distributed as dist

    from dsrun.runtime.distributed.dist import init_distributed
    from dsrun.runtime.parallel import mesh as mesh_mod
    init_distributed()
    mesh_mod.set_current(mesh_mod.ParallelMesh.build(world, model=world))
    me = dist.get_rank()
    _check_groups(world, world)
    _check_column(me, world)
    _check_row(me, world)
    _check_embedding(me, world)
    _check_mlp(me, world)
    _check_sequence_parallel(me, world)
    _check_sequence_dim(me, world)
    _check_cross_entropy(me, world)
    _check_errors(world)
    if world == 4:
        mesh_mod.set_current(mesh_mod.ParallelMesh.build(world, model=2))
        _check_groups(world, 2)
        _check_mlp(me % 2, 2)
        _check_sequence_parallel(me % 2, 2)
        _check_cross_entropy(me % 2, 2)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_layers_match_unsharded(world: int) -> None:
    assert run_ranks(_tensor_parallel_body, world, world, timeout=90) == [True] * world


def test_full_weight_is_the_unsharded_layers() -> None:
    """On one rank (tp = 1) every layer is the torch layer of the same seed."""
    from dsrun.runtime.parallel.tensor import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding)
    for cls, ref_cls in ((ColumnParallelLinear, torch.nn.Linear), (RowParallelLinear, torch.nn.Linear)):
        torch.manual_seed(0)
        ref = ref_cls(H, 3)
        torch.manual_seed(0)
        layer = cls(H, 3)
        assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
    torch.manual_seed(0)
    ref = torch.nn.Embedding(VOCAB, H)
    torch.manual_seed(0)
    assert torch.equal(VocabParallelEmbedding(VOCAB, H).weight, ref.weight)

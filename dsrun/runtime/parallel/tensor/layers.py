"""Megatron-style tensor-parallel layers on the mesh's model axis
(Shoeybi et al. 2019, "Megatron-LM", Section 3), with optional sequence
parallelism (Korthikanti et al. 2022, Section 4.2.2).

[Note: initialising a sharded layer from the full weight]
Each layer builds the *full* weight on every rank, fills it exactly as the
unsharded layer would (nn.Linear's kaiming-uniform weight and uniform bias,
nn.Embedding's normal weight, or the given init_method), and keeps this
rank's slice; Megatron's `_initialize_affine_weight_cpu` does the same. So
when every rank has the same CPU random state at construction (call
torch.manual_seed(seed) on every rank first), the shards of all ranks put
together are exactly the weight nn.Linear / nn.Embedding would draw after
the same seed, whatever the tensor-parallel degree: a model trains the
same from the same seed at any degree, and tests compare to the unsharded
layer. The cost is one full weight in CPU memory per rank while the layer
is built. The full weight is drawn in fp32 on the CPU (the default
generator), then cast to `dtype` and moved to `device`.

[Note: parameters of a sequence-parallel region]
Under sequence parallelism a rank sees only its own tokens between the
layers, so the gradient of a parameter used there (RowParallelLinear's
bias, a LayerNorm's weight and bias) is only this rank's share of the sum
over tokens. Such parameters are marked `param.sequence_parallel = True`;
`allreduce_sequence_parallel_grads` sums their gradients over the model
group after backward and before the optimizer step (Megatron does this in
its gradient finalisation). Sharded parameters are marked
`tensor_model_parallel = True` with `partition_dim` (the dimension split),
as Megatron and DeepSpeed expect (gradient-norm code counts a sharded
parameter on every rank, a replicated one once), and carry `tp_split`, where
their slice sits in the full tensor (split.py [Note: the split a parameter
carries]; checkpoints store the full tensors).

Random draws between a training column layer and the next row layer (the
attention dropout on split heads) come from the model-parallel RNG state
once `model_parallel_cuda_manual_seed` created it (random.py [Note: dropout
in tensor-parallel regions]).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import MeshGroup, ParallelMesh, current
from dsrun.runtime.parallel.tensor.mappings import (copy_to_region, gather_from_region,
                                                    gather_from_sequence_region, reduce_from_region,
                                                    reduce_scatter_to_sequence_region, scatter_to_region)
from dsrun.runtime.parallel.tensor.random import enter_split_region, leave_split_region
from dsrun.runtime.parallel.tensor.split import TensorSplit

InitMethod = Callable[[torch.Tensor], object]


def linear_init(weight: torch.Tensor) -> None:
    """nn.Linear's weight initialisation, in place on a full (out, in) weight:
    kaiming-uniform with a = sqrt(5), i.e. uniform(+-1/sqrt(in))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def model_group(mesh: ParallelMesh | None) -> MeshGroup:
    """The model-axis group of `mesh`, or when None (a layer a script builds
    itself) of the declared mesh ([Note: the declared mesh] in mesh.py)."""
    return (mesh if mesh is not None else current()).axis_group("model")


def _split_size(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} = {size} is not divisible by the tensor-parallel size {parts} "
                         f"(the mesh's model axis); choose a multiple of {parts} or another model degree")
    return size // parts


def _shard(full: torch.Tensor, dim: int, group: MeshGroup, dtype, device) -> nn.Parameter:
    """This rank's slice of `full` along `dim` as a new parameter (see
    [Note: initialising a sharded layer from the full weight])."""
    part = full.chunk(group.size, dim=dim)[group.rank]
    # A copy even when no cast or move is needed: a view would keep all of `full` alive.
    part = part.to(dtype=dtype or torch.get_default_dtype(), device=device)
    return nn.Parameter(part.clone(memory_format=torch.contiguous_format))


def _mark_sharded(param: nn.Parameter, dim: int, full_shape, group: MeshGroup) -> None:
    """Megatron's marks, and where the slice sits in the full tensor
    (`tp_split`, see split.py [Note: the split a parameter carries])."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    param.tp_split = TensorSplit.chunk(tuple(full_shape), dim, group.rank, group.size)


def _linear_bias(out_features: int, in_features: int) -> torch.Tensor:
    """nn.Linear's bias initialisation of a full (out,) bias: uniform(+-1/sqrt(in))."""
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
    return torch.empty(out_features).uniform_(-bound, bound)


def _check_last_dim(x: torch.Tensor, size: int, layer: str, what: str) -> None:
    if x.shape[-1] != size:
        raise ValueError(f"{layer}: the input's last dimension is {x.shape[-1]} but the layer expects "
                         f"{size} ({what})")


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A (out, in) split by output features (rows of A,
    columns of the paper's X A) over the model group.

    Shapes, tp = the model axis size:
        input   (..., in); with sequence_parallel, this rank's tokens:
                (s/tp, ...) along `sequence_dim`
        weight  (out/tp, in), this rank's rows [rank*out/tp, (rank+1)*out/tp)
        bias    (out/tp,)
        output  (..., out/tp); (..., out) with gather_output; with
                sequence_parallel the full sequence s

    Forward communicates nothing (Megatron's f; see mappings.py [Note: the
    conjugate operators]) unless gather_output (an all-gather of the
    output) or sequence_parallel (an all-gather of the input along the
    sequence); backward all-reduces the input gradient (a reduce-scatter
    along the sequence under sequence_parallel). The gathered input is kept
    for the weight gradient (Megatron gathers it again in backward instead).

    Args:
        in_features, out_features: the full layer's sizes.
        bias: whether to add a (sharded) bias.
        gather_output: all-gather the output so every rank has all out
            features (for a layer not followed by a row-parallel one).
        mesh: the mesh whose model axis splits the layer; the current one
            (mesh.current()) when None.
        sequence_parallel: the input is split along `sequence_dim`.
        sequence_dim: the sequence dimension of the input (0 in Megatron's
            (s, b, h) layout).
        init_method: fills the full (out, in) weight in place; nn.Linear's
            by default. The bias is drawn as nn.Linear's. See [Note:
            initialising a sharded layer from the full weight].
        dtype, device: of the parameters.

    Raises:
        ValueError: out_features is not divisible by tp; an input whose last
            dimension is not in_features.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 mesh: ParallelMesh | None = None, sequence_parallel: bool = False, sequence_dim: int = 0,
                 init_method: InitMethod = linear_init, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.group = model_group(mesh)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _split_size(out_features, self.group.size, "ColumnParallelLinear out_features")
        self.gather_output = gather_output
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        full = torch.empty(out_features, in_features)
        init_method(full)
        self.weight = _shard(full, 0, self.group, dtype, device)
        _mark_sharded(self.weight, 0, full.shape, self.group)
        if bias:
            self.bias = _shard(_linear_bias(out_features, in_features), 0, self.group, dtype, device)
            _mark_sharded(self.bias, 0, (out_features,), self.group)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, mesh: ParallelMesh | None = None,
                  gather_output: bool = False, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> ColumnParallelLinear:
        """The layer holding this rank's rows of a trained full layer: `weight`
        (out, in) and `bias` (out,) or None; dtype and device default to the
        weight's. Draws nothing from the random generator (automatic tensor
        parallelism replaces a model's nn.Linear by this). The parameters'
        `tp_split` says they are chunks of `weight` and `bias`; a caller
        passing rows reordered or repeated (fused q/k/v, replicated heads)
        sets the true split (autotp.py does), or checkpoints would store
        the reordered tensor.

        Raises:
            ValueError: out is not divisible by tp.
        """
        weight = weight.detach()
        dtype, device = dtype or weight.dtype, device or weight.device
        layer = cls(weight.shape[1], weight.shape[0], bias=False, gather_output=gather_output, mesh=mesh,
                    init_method=lambda full: full.copy_(weight), dtype=dtype, device=device)
        if bias is not None:
            layer.bias = _shard(bias.detach(), 0, layer.group, dtype, device)
            _mark_sharded(layer.bias, 0, bias.shape, layer.group)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.in_features, "ColumnParallelLinear", "in_features")
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.group, self.sequence_dim)
        else:
            x = copy_to_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            leave_split_region()  # the output is replicated
            return gather_from_region(y, self.group)
        if self.training:  # the output is split: see random.py [Note: dropout in tensor-parallel regions]
            enter_split_region()
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_per_rank} on this rank), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A (out, in) split by input features (columns of
    A, rows of the paper's B) over the model group.

    Shapes, tp = the model axis size:
        input   (..., in/tp), this rank's features (input_is_parallel, e.g.
                a ColumnParallelLinear's output), or (..., in), then split here
        weight  (out, in/tp), this rank's columns [rank*in/tp, (rank+1)*in/tp)
        bias    (out,), the same on every rank
        output  (..., out); with sequence_parallel, this rank's tokens:
                (s/tp, ...) along `sequence_dim`

    Forward all-reduces the partial products over the model group (Megatron's
    g), or reduce-scatters them along the sequence under sequence_parallel
    (whose bias is then a sequence-parallel parameter: see [Note: parameters
    of a sequence-parallel region]); the bias is added after the reduction.
    Backward needs no communication (an all-gather along the sequence under
    sequence_parallel; an all-gather of the input gradient when the input
    was split here).

    Args:
        in_features, out_features: the full layer's sizes.
        bias: whether to add a bias.
        input_is_parallel: the input is already this rank's slice of the
            in features; when False, the full input is split here.
        mesh: the mesh whose model axis splits the layer; the current one
            when None.
        sequence_parallel: reduce-scatter the output along `sequence_dim`.
        sequence_dim: the sequence dimension of the output.
        init_method: fills the full (out, in) weight in place; nn.Linear's
            by default. The bias is drawn as nn.Linear's. See [Note:
            initialising a sharded layer from the full weight].
        dtype, device: of the parameters.

    Raises:
        ValueError: in_features is not divisible by tp; sequence_parallel
            without input_is_parallel (Megatron's rule: the sequence-parallel
            output needs its input from a column-parallel layer); an input
            of the wrong last dimension.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 mesh: ParallelMesh | None = None, sequence_parallel: bool = False, sequence_dim: int = 0,
                 init_method: InitMethod = linear_init, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                             "(feed it a ColumnParallelLinear's output)")
        self.group = model_group(mesh)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _split_size(in_features, self.group.size, "RowParallelLinear in_features")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        full = torch.empty(out_features, in_features)
        init_method(full)
        self.weight = _shard(full, 1, self.group, dtype, device)
        _mark_sharded(self.weight, 1, full.shape, self.group)
        if bias:
            full_bias = _linear_bias(out_features, in_features)
            self.bias = nn.Parameter(full_bias.to(dtype=dtype or torch.get_default_dtype(), device=device))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, mesh: ParallelMesh | None = None,
                  dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> RowParallelLinear:
        """The layer (input_is_parallel) holding this rank's columns of a
        trained full layer: `weight` (out, in) and `bias` (out,), kept whole,
        or None; dtype and device default to the weight's. Draws nothing
        from the random generator. The weight's `tp_split` says it is a
        chunk of `weight` (see ColumnParallelLinear.from_full).

        Raises:
            ValueError: in is not divisible by tp.
        """
        weight = weight.detach()
        dtype, device = dtype or weight.dtype, device or weight.device
        layer = cls(weight.shape[1], weight.shape[0], bias=False, mesh=mesh,
                    init_method=lambda full: full.copy_(weight), dtype=dtype, device=device)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(dtype=dtype, device=device).clone())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:  # the output is replicated: see random.py [Note: dropout in ...]
            leave_split_region()
        if self.input_is_parallel:
            _check_last_dim(x, self.in_per_rank, "RowParallelLinear", "in_features / tensor-parallel size")
        else:
            _check_last_dim(x, self.in_features, "RowParallelLinear", "in_features")
            x = scatter_to_region(x, self.group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, self.group, self.sequence_dim)
            if self.training:  # this rank's tokens: a sequence-parallel region (random.py)
                enter_split_region()
        else:
            y = reduce_from_region(partial, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} on this rank), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table (num_embeddings, embedding_dim) split by rows (the
    vocabulary) over the model group (Megatron-LM Section 3, the input
    embedding).

    Shapes, tp = the model axis size, V = num_embeddings:
        input   token ids, integer, any shape (...), the same on every rank
        weight  (V/tp, embedding_dim): rows [rank*V/tp, (rank+1)*V/tp)
        output  (..., embedding_dim); with sequence_parallel, this rank's
                tokens: (s/tp, ...) along `sequence_dim`

    Each rank looks up the ids in its rows, writes zeros for the others, and
    the ranks' results are summed (all-reduce; a reduce-scatter along the
    sequence under sequence_parallel). Unlike nn.Embedding, an id outside
    [0, V) gives a zero vector, not an error (checking would need every
    rank's answer). Backward needs no communication: each rank's weight
    gradient has the rows of its ids.

    Args:
        num_embeddings, embedding_dim: the full table's sizes.
        mesh: the mesh whose model axis splits the table; the current one
            when None.
        sequence_parallel, sequence_dim: reduce-scatter the output along
            this dimension of the ids.
        init_method: fills the full table in place; nn.Embedding's normal(0, 1)
            by default (see [Note: initialising a sharded layer from the
            full weight]).
        dtype, device: of the weight.

    Raises:
        ValueError: num_embeddings is not divisible by tp.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh: ParallelMesh | None = None,
                 sequence_parallel: bool = False, sequence_dim: int = 0,
                 init_method: InitMethod = nn.init.normal_, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.group = model_group(mesh)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = _split_size(num_embeddings, self.group.size, "VocabParallelEmbedding num_embeddings")
        self.vocab_start = self.group.rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        full = torch.empty(num_embeddings, embedding_dim)
        init_method(full)
        self.weight = _shard(full, 0, self.group, dtype, device)
        _mark_sharded(self.weight, 0, full.shape, self.group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        leave_split_region()  # a forward begins in the replicated region (random.py)
        if self.group.size == 1:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_region(out, self.group, self.sequence_dim)
            if self.training:  # this rank's tokens: a sequence-parallel region (random.py)
                enter_split_region()
            return out
        return reduce_from_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) "
                f"on this rank, sequence_parallel={self.sequence_parallel}")


def allreduce_sequence_parallel_grads(module: nn.Module, mesh: ParallelMesh | None = None) -> int:
    """Sum, over the model group, the gradients of `module`'s parameters
    marked `sequence_parallel = True` (see [Note: parameters of a
    sequence-parallel region]); call after backward, before the optimizer
    step. One all-reduce of the flattened gradients; parameters without a
    gradient are skipped (the same set on every rank of the group, as they
    hold the same layers).

    Returns:
        The number of gradients summed.
    """
    group = model_group(mesh)
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or group.size == 1:
        return len(grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group.group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))
    return len(grads)

"""Automatic tensor parallelism (DeepSpeed's AutoTP training): replace, in
place, the linear layers of an ordinary transformer by the Megatron layers
of layers.py. `deepspeed.tp_model_init` over it is
dsrun/runtime/engine/tp_model_init.py.

[Note: which layer goes where]
A layer is placed by the last component of its module path, as DeepSpeed's
AutoTP and torchtitan's parallelize plans do (a name-based plan, never a
guess from shapes):

    column-parallel   q_proj k_proj v_proj gate_proj up_proj (Llama, Mistral),
                      c_fc (GPT-2), fc (examples/gpt_model.py)
    fused q/k/v       c_attn (GPT-2), qkv (examples/gpt_model.py): the rows
                      are q, k and v blocks, each head-major; rank r keeps
                      heads [r*H/tp, (r+1)*H/tp) of each block, so its
                      output is again [q | k | v] for its heads
    row-parallel      o_proj down_proj (Llama, Mistral), c_proj (GPT-2,
                      attention and MLP), proj (examples/gpt_model.py)
    kept whole        lm_head, head (the output layer; with the embeddings
                      it stays replicated, unless vocab_parallel: see
                      vocab.py); every layer inside an MoE layer (its gate
                      and experts: each tensor rank routes the same whole
                      tokens, so the experts stay whole and replicated
                      over the model axis, split only over their
                      expert-parallel group)

Any other nn.Linear (or GPT-2's Conv1D, an nn.Linear with its weight stored
transposed, (in, out)) raises ValueError naming its module path. Each
column layer followed by a row layer is Megatron's MLP or attention block
(Shoeybi et al. 2019, Section 3): one all-reduce in forward and one in
backward per block.

[Note: attention heads]
The module holding q/k/v is the attention module. Its query heads H must be
divisible by tp; each rank computes H/tp heads, so its head-count attributes
(`num_heads`, `n_head`, `num_attention_heads`, `num_key_value_heads`,
`num_key_value_groups`, and GPT-2's `split_size`, the width of one of q, k,
v) are set to this rank's. Grouped-query attention with KV key/value heads:
when tp divides KV each rank keeps KV/tp of them; when KV divides tp (fewer
heads than ranks) rank r keeps head r // (tp/KV) whole, which serves
exactly the query heads of rank r. Those k/v weights are then held by the
tp/KV ranks of a "replica group" (the model axis split into blocks of tp/KV
consecutive ranks, mesh.data_blocks(tp/KV, "model")); each rank's gradient
is only its query heads' share, so the replicas' gradients are summed before
the step and the norm counts them once (`tp_replica_group` on the
parameter; see dsrun/runtime/engine/model_parallel.py).

[Note: sharding from one full model]
tp_model_init first broadcasts the whole model from global rank 0 (unless
it was built under zero.Init: see dsrun/runtime/zero/tensor_parallel.py), then
every rank cuts its slices from the same full weights, so the sharded model
computes what the original did whatever each rank's seed was (the cost: one
broadcast of the full model). Dropout between a column and a row layer
(attention dropout on the split heads) draws a different mask on each
tensor-parallel rank once `dsrun.checkpointing.model_parallel_cuda_manual_seed`
was called, the same mask on all of them otherwise (see random.py [Note:
dropout in tensor-parallel regions]).
"""
from __future__ import annotations

import torch
from torch import nn

from dsrun.runtime import comm
from dsrun.runtime.config import ConfigError
from dsrun.runtime.parallel.expert.layer import MoE
from dsrun.runtime.parallel.mesh import MeshGroup, ParallelMesh
from dsrun.runtime.parallel.tensor.full import PLAIN, FullTensors
from dsrun.runtime.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from dsrun.runtime.parallel.tensor.split import TensorSplit

COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_fc", "fc"})
FUSED_QKV = frozenset({"c_attn", "qkv"})
ROW = frozenset({"o_proj", "down_proj", "c_proj", "proj"})
KEPT_WHOLE = frozenset({"lm_head", "head"})
_QUERY = frozenset({"q_proj"}) | FUSED_QKV
_KEY_VALUE = frozenset({"k_proj", "v_proj"})
_HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads")


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): y = x W + b with W (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _first_int(obj, names) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class _Heads:
    """The head layout of one attention module: H query heads, KV key/value
    heads, head_dim channels each."""

    def __init__(self, path: str, attention: nn.Module, config, tp: int, q_out: int, fused: bool) -> None:
        heads = _first_int(attention, _HEAD_ATTRS) or _first_int(config, ("num_attention_heads", "n_head"))
        if heads is None:
            raise ValueError(f"tensor parallelism: cannot find the number of attention heads of {path!r} "
                             f"(no attribute {' / '.join(_HEAD_ATTRS)} on it or on the model's config)")
        kv = _first_int(attention, _KV_ATTRS) or _first_int(config, ("num_key_value_heads",)) or heads
        if fused:
            kv = heads
        width = q_out // 3 if fused else q_out
        if width % heads:
            raise ValueError(f"tensor parallelism: {path!r} has {width} query features, not a multiple of "
                             f"its {heads} heads")
        if heads % tp:
            raise ValueError(f"tensor parallelism: {path!r} has {heads} attention heads, which "
                             f"{tp} tensor-parallel ranks cannot split; choose a tp_size dividing {heads}")
        if kv % tp and tp % kv:
            raise ValueError(f"tensor parallelism: {path!r} has {kv} key/value heads and tp_size={tp}: one "
                             "must divide the other (heads are split, or replicated when fewer than tp)")
        self.heads, self.kv, self.head_dim, self.tp = heads, kv, width // heads, tp

    def update(self, attention: nn.Module) -> None:
        """Set the attention module's head attributes to this rank's (see [Note: attention heads])."""
        q_local, kv_local = self.heads // self.tp, max(self.kv // self.tp, 1)
        for name in _HEAD_ATTRS:
            if _first_int(attention, (name,)) is not None:
                setattr(attention, name, q_local)
        for name in _KV_ATTRS:
            if _first_int(attention, (name,)) is not None:
                setattr(attention, name, kv_local)
        if _first_int(attention, ("num_key_value_groups",)) is not None:
            attention.num_key_value_groups = q_local // kv_local
        if _first_int(attention, ("split_size",)) is not None:
            attention.split_size = q_local * self.head_dim


def _fused_qkv_order(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """Rows of a fused (3*H*d, ...) q/k/v weight (or bias) reordered so that
    chunk r of tp is [q_r | k_r | v_r], rank r's heads of each block."""
    blocks = weight.reshape(3, tp, weight.shape[0] // (3 * tp), *weight.shape[1:])
    return blocks.transpose(0, 1).reshape(weight.shape)


def _replicated_kv(weight: torch.Tensor, heads: _Heads) -> torch.Tensor:
    """A (KV*d, ...) key or value weight (or bias) with each head repeated
    tp/KV times, so that chunk r of tp is head r // (tp/KV)."""
    per_head = weight.reshape(heads.kv, heads.head_dim, *weight.shape[1:])
    return per_head.repeat_interleave(heads.tp // heads.kv, dim=0).reshape(-1, *weight.shape[1:])


def _record_splits(new: nn.Module, old: nn.Module, leaf: str, heads: _Heads | None, mesh: ParallelMesh,
                   full: FullTensors) -> None:
    """Give the new layer's parameters the split of the *original* layer's
    tensors (see split.py [Note: the split a parameter carries]): GPT-2's
    Conv1D weight is stored (in, out), a fused q/k/v layer holds three row
    ranges, a replicated key/value head the rows of head r // (tp/KV)."""
    tp, rank = mesh.size("model"), mesh.rank("model")
    for name, param in new.named_parameters():
        split = param.tp_split if hasattr(param, "tp_split") else None
        if split is None:  # a row-parallel layer's bias: whole on every rank
            continue
        shape = tuple(full.shape(getattr(old, name)))
        dim, ranges = split.dim, split.ranges
        if leaf in FUSED_QKV:
            width = shape[-1 if name == "weight" and _is_conv1d(old) else 0] // 3
            per = width // tp
            ranges = tuple((block * width + rank * per, block * width + (rank + 1) * per) for block in range(3))
        elif leaf in _KEY_VALUE and heads is not None and heads.kv < tp:
            head = rank // (tp // heads.kv)
            ranges = ((head * heads.head_dim, (head + 1) * heads.head_dim),)
        param.tp_split = TensorSplit(shape, dim, ranges, name == "weight" and _is_conv1d(old), rank, tp)


def placement_plan(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """(module path, rule name, layer) of every linear layer of `model` that
    tensor parallelism replaces (see [Note: which layer goes where]); the
    output layers and the gates and experts of MoE layers, kept whole, are
    left out. Changes nothing.

    Raises:
        ValueError: a linear layer that no rule places, naming its module path.
    """
    plan = []
    moe = tuple(f"{path}." for path, module in model.named_modules() if isinstance(module, MoE))
    for path, module in model.named_modules():
        if not _is_linear(module) or not path:
            continue
        leaf = path.rsplit(".", 1)[-1]
        if leaf in KEPT_WHOLE or path.startswith(moe):
            continue
        if leaf not in COLUMN | FUSED_QKV | ROW:
            raise ValueError(f"tensor parallelism cannot place layer {path!r} ({type(module).__name__}): "
                             f"its name is none of column-parallel {sorted(COLUMN | FUSED_QKV)}, row-parallel "
                             f"{sorted(ROW)} or kept whole {sorted(KEPT_WHOLE)}; rename it, or shard the model "
                             "by hand with ColumnParallelLinear/RowParallelLinear")
        plan.append((path, leaf, module))
    return plan


def _plan_layers(model: nn.Module, tp: int,
                 full: FullTensors) -> list[tuple[nn.Module, str, nn.Module, _Heads | None]]:
    """(parent, leaf, layer, heads of its attention module or None) of every
    layer shard_model replaces, checked from the full shapes alone (`full`:
    see [Note: full tensors] in full.py) so that an error leaves the model
    unchanged.

    Raises:
        ValueError: as shard_model.
    """
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    modules = dict(model.named_modules())
    attention_heads: dict[str, _Heads] = {}
    layers = []
    for path, leaf, module in placement_plan(model):
        parent_path = path.rsplit(".", 1)[0] if "." in path else ""
        parent = modules[parent_path]
        if leaf in _QUERY | _KEY_VALUE and parent_path not in attention_heads:
            query = next((q for q in sorted(_QUERY)
                          if isinstance(getattr(parent, q, None), nn.Module) and _is_linear(getattr(parent, q))),
                         None)
            if query is None:
                raise ValueError(f"tensor parallelism: {path!r} has no query projection beside it "
                                 f"({' / '.join(sorted(_QUERY))}) to count its attention heads")
            q_out = _weight_shape(getattr(parent, query), full)[0]
            attention_heads[parent_path] = _Heads(parent_path or "<model>", parent, config, tp, q_out,
                                                  fused=query in FUSED_QKV)
        if leaf in _QUERY | _KEY_VALUE:  # split by heads, checked by _Heads
            layers.append((parent, leaf, module, attention_heads[parent_path]))
            continue
        out_features, in_features = _weight_shape(module, full)
        split, what = (in_features, "in_features") if leaf in ROW else (out_features, "out_features")
        if split % tp:
            raise ValueError(f"tensor parallelism cannot split layer {path!r}: its {what} = {split} is not "
                             f"divisible by the tensor-parallel size {tp}; choose a tp_size dividing {split}")
        layers.append((parent, leaf, module, attention_heads.get(parent_path)))
    return layers


def _weight_shape(module: nn.Module, full: FullTensors) -> tuple[int, int]:
    """(out, in) of an nn.Linear or a Conv1D, from its weight's full shape."""
    shape = tuple(full.shape(module.weight))
    return shape[::-1] if _is_conv1d(module) else shape


def _build_layer(module: nn.Module, leaf: str, heads: _Heads | None, mesh: ParallelMesh,
                 dtype: torch.dtype | None, full: FullTensors) -> nn.Module:
    """The tensor-parallel layer replacing `module`, cut from its full weight
    as `full` reads it (gathered first when built under zero.Init)."""
    weight = full.value(module.weight)
    weight = weight.t() if _is_conv1d(module) else weight
    bias = full.value(module.bias) if getattr(module, "bias", None) is not None else None
    if leaf in FUSED_QKV:
        weight = _fused_qkv_order(weight, heads.tp)
        bias = _fused_qkv_order(bias, heads.tp) if bias is not None else None
    replicate = leaf in _KEY_VALUE and heads.kv < heads.tp
    if replicate:
        weight = _replicated_kv(weight, heads)
        bias = _replicated_kv(bias, heads) if bias is not None else None
    if leaf in ROW:
        return RowParallelLinear.from_full(weight, bias, mesh=mesh, dtype=dtype)
    return ColumnParallelLinear.from_full(weight, bias, mesh=mesh, dtype=dtype)


def shard_model(model: nn.Module, mesh: ParallelMesh, dtype: torch.dtype | None = None,
                full: FullTensors = PLAIN) -> nn.Module:
    """Replace, in place, the linear layers of `model` by tensor-parallel ones
    over `mesh`'s model axis (see [Note: which layer goes where] and [Note:
    attention heads]); every rank must hold the same full weights, or the
    same model built under zero.Init with `full` the ZeRO reader of its
    shards (its layers are gathered one at a time: see
    dsrun/runtime/zero/tensor_parallel.py [Note: tensor parallelism of a
    zero.Init model]). Collective over the job when grouped-query key/value
    heads are replicated (creates the replica groups) or the model was
    built under zero.Init.

    Returns:
        `model` itself.

    Raises:
        ValueError: a linear layer no rule places (its module path named), a
            head count or width the model axis cannot split; raised before
            anything changes.
    """
    tp = mesh.size("model")
    layers = _plan_layers(model, tp, full)
    if tp == 1:
        return model
    replicas: dict[int, MeshGroup] = {}  # ranks per replicated key/value head -> this rank's group
    attentions = {id(parent): (parent, heads) for parent, leaf, _, heads in layers
                  if leaf in _QUERY | _KEY_VALUE}
    while layers:  # popped, so that a replaced layer (and its zero.Init shards) is freed at once
        parent, leaf, module, heads = layers.pop(0)
        new = _build_layer(module, leaf, heads, mesh, dtype, full)
        _record_splits(new, module, leaf, heads, mesh, full)
        if leaf in _KEY_VALUE and heads.kv < tp:
            size = tp // heads.kv
            if size not in replicas:
                replicas[size] = mesh.data_blocks(size, axis="model").block
            for p in new.parameters():
                p.tp_replica_group = replicas[size]
        setattr(parent, leaf, new)
        del module
    for attention, heads in attentions.values():
        heads.update(attention)
    if dtype is not None:
        model.to(dtype=dtype)
    return model


def check_shardable(model: nn.Module, tp: int, full: FullTensors = PLAIN) -> None:
    """Raise ConfigError when shard_model could not shard `model` over `tp`
    ranks (a layer no rule places, heads or widths `tp` does not divide),
    naming the layer and the numbers; changes nothing, communicates nothing
    (initialize calls it before its first collective, so that a pipeline
    stage that cannot be sharded stops every rank, not only its own)."""
    try:
        _plan_layers(model, tp, full)
    except ValueError as exc:
        raise ConfigError(f"tensor_parallel.autotp_size={tp}: {exc}") from None


def shard_stage(stage: nn.Module, mesh: ParallelMesh, dtype: torch.dtype | None = None,
                full: FullTensors = PLAIN) -> nn.Module:
    """AutoTP of one pipeline stage (`tensor_parallel.autotp_size` with a
    PipelineModule): the stage's layers, which only the ranks of this stage
    hold, are first made equal over `mesh`'s model axis (a broadcast from
    its first rank, so that every model rank cuts its slices from the same
    full weights: [Note: sharding from one full model] within the stage),
    then sharded by name as shard_model does. The data and sequence ranks
    of the stage get the first one's values afterwards (initialize's
    broadcast over ZeRO's group). Marks the stage `ds_autotp_parsed`.
    Collective over the job (every rank calls it, each on its own stage).

    Returns:
        `stage` itself, sharded.

    Raises:
        ValueError: a layer no rule places (named), or heads the model axis
            cannot split; before any communication (initialize checks this
            earlier, on every rank: check_shardable).
    """
    _plan_layers(stage, mesh.size("model"), full)
    model_group = mesh.axis_group("model")
    if model_group.size > 1:
        with torch.no_grad():
            for tensor in list(stage.parameters()) + list(stage.buffers()):
                comm.broadcast(tensor.data, src=model_group.ranks[0], group=model_group.group)
    shard_model(stage, mesh, dtype, full)
    stage.ds_autotp_parsed = True
    return stage

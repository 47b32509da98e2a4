"""Vocabulary parallelism in automatic tensor parallelism
(`tp_model_init(..., vocab_parallel=True)`, config
`tensor_parallel.vocab_parallel`).

[Note: vocabulary-parallel embedding and output layer]
The input embedding (V, h) is replaced by a VocabParallelEmbedding: rank r
keeps rows [r*V/tp, (r+1)*V/tp) and the ranks' lookups are summed
(Megatron-LM, Shoeybi et al. 2019, Section 3). The output layer (h -> V,
`lm_head` / `head`) becomes a ColumnParallelLinear over the same rows with
gather_output: each rank computes the logits of its vocabulary slice and
they are all-gathered, so the model's own loss (Hugging Face's
`labels=`, the byte GPT's `targets`) sees the full logits and computes what
the unsharded model does. When the output layer's weight *is* the
embedding's (tied, as GPT-2 and the byte GPT), the two new layers share one
parameter, the rank's rows, and stay tied; an untied output layer (Llama)
is split the same way with its own weight. Position embeddings stay
replicated.

What it saves: the embedding and output weights, their gradients and
optimizer states are 1/tp per rank (the largest tensors of a small-hidden,
large-vocabulary model). What it does not: the full (b, s, V) logits are
still built on every rank, since the model's loss reads them; a training
loop computing its own loss should instead keep the head's output split and
call `vocab_parallel_cross_entropy` (cross_entropy.py), which never gathers
them -- automatic tensor parallelism cannot change a model's loss code.

The input embedding is found by the model's `get_input_embeddings()`
(Hugging Face) or the name of an nn.Embedding (INPUT_EMBEDDINGS); refused
with a ValueError naming it: a vocabulary the model axis does not divide, an
embedding with padding_idx, max_norm, scale_grad_by_freq or sparse (their
semantics need the whole table), an output layer of another width than the
vocabulary, or with a bias while tied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.parallel.tensor.layers import ColumnParallelLinear, VocabParallelEmbedding
from dsrun.runtime.parallel.tensor.full import FullTensors

INPUT_EMBEDDINGS = frozenset({"wte", "embed_tokens", "tok_emb", "word_embeddings"})
OUTPUT_LAYERS = frozenset({"lm_head", "head"})


@dataclass
class VocabPlan:
    """The layers vocabulary parallelism replaces: (parent, attribute name,
    module) of the input embedding and of the output layer (None: the model
    has none), and whether the output layer's weight is the embedding's."""

    embedding: tuple[nn.Module, str, nn.Embedding]
    output: tuple[nn.Module, str, nn.Linear] | None
    tied: bool


def _located(model: nn.Module, target: nn.Module) -> tuple[nn.Module, str, str]:
    """(parent, attribute, path) of submodule `target` of `model`."""
    modules = dict(model.named_modules())
    for path, module in modules.items():
        if module is target and path:
            parent_path, _, leaf = path.rpartition(".")
            return modules[parent_path], leaf, path
    raise ValueError(f"vocab_parallel: {type(target).__name__} is not a submodule of the model")


def _input_embedding(model: nn.Module) -> nn.Embedding:
    getter = getattr(model, "get_input_embeddings", None)
    found = getter() if callable(getter) else None
    if isinstance(found, nn.Embedding):
        return found
    named = [m for p, m in model.named_modules() if isinstance(m, nn.Embedding)
             and p.rpartition(".")[2] in INPUT_EMBEDDINGS]
    if len(named) != 1:
        raise ValueError(f"vocab_parallel: cannot find the model's input embedding (get_input_embeddings(), "
                         f"or one nn.Embedding named one of {sorted(INPUT_EMBEDDINGS)}; found {len(named)}); "
                         "leave vocab_parallel off")
    return named[0]


def plan_vocabulary(model: nn.Module, tp: int, full: FullTensors) -> VocabPlan:
    """Find and check the layers vocabulary parallelism replaces (see [Note:
    vocabulary-parallel embedding and output layer]) from their full shapes
    as `full` reads them (see [Note: full tensors] in full.py); changes
    nothing.

    Raises:
        ValueError: no input embedding found, or one of the refusals of the
            Note, naming the layer.
    """
    embedding = _input_embedding(model)
    parent, leaf, path = _located(model, embedding)
    vocab, width = tuple(full.shape(embedding.weight))
    for option, default in (("padding_idx", None), ("max_norm", None), ("scale_grad_by_freq", False),
                            ("sparse", False)):
        if getattr(embedding, option, default) != default:
            raise ValueError(f"vocab_parallel: embedding {path!r} has {option}={getattr(embedding, option)!r}, "
                             "which a vocabulary-parallel table does not implement; leave vocab_parallel off")
    if vocab % tp:
        raise ValueError(f"vocab_parallel: embedding {path!r} has {vocab} rows, not divisible by the "
                         f"tensor-parallel size {tp}; pad the vocabulary to a multiple of {tp} or leave "
                         "vocab_parallel off")
    output = None
    for out_path, module in model.named_modules():
        if out_path.rpartition(".")[2] in OUTPUT_LAYERS and isinstance(module, nn.Linear):
            out_parent, out_leaf, _ = _located(model, module)
            output = (out_parent, out_leaf, module)
            if tuple(full.shape(module.weight)) != (vocab, width):
                raise ValueError(f"vocab_parallel: output layer {out_path!r} has weight "
                                 f"{tuple(full.shape(module.weight))}, not the embedding's ({vocab}, {width}); "
                                 "leave vocab_parallel off")
            break
    tied = output is not None and output[2].weight is embedding.weight
    if tied and output[2].bias is not None:
        raise ValueError(f"vocab_parallel: output layer {output[1]!r} is tied to the embedding but has a bias; "
                         "leave vocab_parallel off")
    return VocabPlan((parent, leaf, embedding), output, tied)


def shard_vocabulary(plan: VocabPlan, mesh: ParallelMesh, dtype: torch.dtype | None,
                     full: FullTensors) -> None:
    """Replace the planned layers in place by a VocabParallelEmbedding and a
    gathering ColumnParallelLinear over `mesh`'s model axis (see [Note:
    vocabulary-parallel embedding and output layer]), cut from the full
    weights as `full` reads them. Every rank must hold the same full weights
    (or the same zero.Init model: each is gathered once, collective)."""
    parent, leaf, embedding = plan.embedding
    weight = full.value(embedding.weight)
    dtype = dtype or weight.dtype
    new = VocabParallelEmbedding(weight.shape[0], weight.shape[1], mesh=mesh,
                                 init_method=lambda table: table.copy_(weight), dtype=dtype, device=weight.device)
    new.weight.requires_grad_(embedding.weight.requires_grad)
    setattr(parent, leaf, new)
    if plan.output is None:
        return
    out_parent, out_leaf, output = plan.output
    if plan.tied:
        head = ColumnParallelLinear(new.embedding_dim, new.num_embeddings, bias=False, gather_output=True,
                                    mesh=mesh, init_method=nn.init.zeros_, dtype=dtype, device=new.weight.device)
        head.weight = new.weight  # one parameter: the tie holds
    else:
        bias = full.value(output.bias) if output.bias is not None else None
        head = ColumnParallelLinear.from_full(full.value(output.weight), bias, mesh=mesh, gather_output=True,
                                              dtype=dtype)
    setattr(out_parent, out_leaf, head)

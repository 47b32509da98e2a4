"""Parameter gradients of common layers from their input and output
gradient, without the autograd graph: the weight pass (W) of zero-bubble
pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024, section 2: W of a linear layer is one matrix product of the output
gradient and the saved input).

[Note: weight pass by rule]
The input pass (B) leaves, for every parameter-owning module the forward
ran, the gradient of its output. For the layers below the parameter
gradients are closed formulas of that gradient and the module's input,
which the forward already keeps for the backward (no extra memory):

- ``nn.Linear`` (y = x W^T + b): dW = dy^T x, db = sum of dy, over all
  leading dimensions (the products autograd's addmm/mm backward computes);
- ``nn.LayerNorm``: dgamma = sum of dy * x_hat, dbeta = sum of dy, with
  x_hat = layer_norm(x) without the affine part recomputed from x (one
  elementwise pass, cheaper than keeping the layer's graph);
- ``nn.Embedding`` (dense, no max_norm, no scale_grad_by_freq): dW =
  dy's rows added at their indices, the padding row left zero.

A rule applies only to a module of exactly that class (a subclass may
change the forward; ``has_rule``) called with its input as the one
positional argument; the caller runs autograd for any other module. The pipeline engine applies the gradients of a whole micro-batch
with ONE autograd call on the parameters (so gradient hooks, accumulation
and the data-parallel reduction are the usual ones) instead of one
autograd call per module, whose fixed cost (engine start, graph walk, on a
GPU a hand-off to the device thread) dominated small and many layers.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

_Grads = list[tuple[torch.nn.Parameter, torch.Tensor]]


def _linear(m: torch.nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> _Grads:
    dy2 = dy.reshape(-1, dy.shape[-1])
    out = [(m.weight, dy2.t().mm(x.reshape(-1, x.shape[-1]).to(dy2.dtype)))]
    if m.bias is not None:
        out.append((m.bias, dy2.sum(0)))
    return out


def _layer_norm(m: torch.nn.LayerNorm, x: torch.Tensor, dy: torch.Tensor) -> _Grads:
    dims = tuple(range(x.dim() - len(m.normalized_shape)))
    out = []
    if m.weight is not None:
        x_hat = F.layer_norm(x.to(dy.dtype), m.normalized_shape, None, None, m.eps)
        out.append((m.weight, (dy * x_hat).sum(dims)))
    if m.bias is not None:
        out.append((m.bias, dy.sum(dims)))
    return out


def _embedding(m: torch.nn.Embedding, idx: torch.Tensor, dy: torch.Tensor) -> _Grads:
    rows = dy.reshape(-1, m.embedding_dim)
    grad = torch.zeros(m.weight.shape, dtype=rows.dtype, device=rows.device).index_add_(0, idx.reshape(-1), rows)
    if m.padding_idx is not None:
        grad[m.padding_idx] = 0
    return [(m.weight, grad)]


_RULES: dict[type, Callable] = {torch.nn.Linear: _linear, torch.nn.LayerNorm: _layer_norm,
                                torch.nn.Embedding: _embedding}


def has_rule(module: torch.nn.Module) -> bool:
    """Whether `weight_grads` covers `module`: its class exactly (not a
    subclass) has a rule, and for an embedding its options are the plain
    dense ones."""
    if type(module) is torch.nn.Embedding:
        return not (module.sparse or module.max_norm is not None or module.scale_grad_by_freq)
    return type(module) in _RULES


def weight_grads(module: torch.nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> _Grads:
    """The gradients of `module`'s own parameters (those requiring grad) for
    one call `output = module(inputs)` whose output gradient is
    `output_grad` (same shape as the output), per [Note: weight pass by rule].

    Returns:
        [(parameter, gradient)], each gradient in its parameter's dtype
        and shape.

    Raises:
        KeyError: `has_rule(module)` is False.
    """
    with torch.no_grad():
        found = _RULES[type(module)](module, inputs, output_grad)
    return [(p, g.to(p.dtype)) for p, g in found if p.requires_grad]

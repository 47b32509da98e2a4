"""What the gradient strategy must know when one copy of the model is split
over several ranks (pipeline stages and tensor-parallel ranks: the mesh's
"pipe_model" group), and the gradient sums tensor parallelism needs before
the optimizer step.

[Note: counting each gradient once]
The strategy averages gradients over the data axis only. The step's global
gradient norm and its non-finite check must cover the whole model: each
rank's squared norm is summed over its pipe_model group (StageSpan in
dsrun/runtime/strategy/data_parallel.py), minus the gradients another rank
of the group also holds in full ("duplicates"), so that each counts once:

- copies of a weight tied across pipeline stages, on every stage but the
  first that uses it (`ds_pipe_replicated`, set by PipelineModule);
- parameters replicated over the model axis (LayerNorm, embeddings, a row-
  parallel layer's bias: those not marked `tensor_model_parallel`), on
  model rank > 0 -- the shards of a tensor-parallel weight are different
  on each rank and all count;
- a tensor-parallel slice held by several model ranks (grouped-query
  key/value heads fewer than tp, see autotp.py [Note: attention heads]),
  on every rank of its `tp_replica_group` but the first.

[Note: gradient sums before the step]
Two kinds of parameter get only a share of their gradient on each model
rank: those of a sequence-parallel region (`sequence_parallel = True`,
layers.py [Note: parameters of a sequence-parallel region]) and replicated
key/value slices (`tp_replica_group`). After the data-parallel average and
before the step their gradients are summed over their group through
`strategy.sum_gradients_across` (the sum the strategy already does for tied
pipeline weights, which knows where a ZeRO stage keeps the gradient;
`allreduce_sequence_parallel_grads` does the same on plain `.grad`s). The
engine runs it as a pre-step hook (`Engine.register_pre_step_hook`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.strategy.data_parallel import GradientStrategy, StageSpan


def duplicate_params(module: torch.nn.Module, mesh: ParallelMesh) -> frozenset[int]:
    """Ids of `module`'s parameters left out of the norm on this rank (see
    [Note: counting each gradient once])."""
    model_rank = mesh.rank("model")
    found = set()
    for p in module.parameters():
        replica = getattr(p, "tp_replica_group", None)
        if (getattr(p, "ds_pipe_replicated", False)
                or (model_rank > 0 and not getattr(p, "tensor_model_parallel", False))
                or (replica is not None and replica.rank > 0)):
            found.add(id(p))
    return frozenset(found)


def model_parallel_span(module: torch.nn.Module, mesh: ParallelMesh) -> StageSpan | None:
    """The StageSpan over the mesh's pipe_model group, or None when one rank
    holds the whole model."""
    group = mesh.axis_group("pipe_model")
    if group.size == 1:
        return None
    return StageSpan(mesh.group("pipe_model"), group.size, duplicate_params(module, mesh))


def partial_gradient_groups(module: torch.nn.Module, mesh: ParallelMesh) -> list[tuple[list, object]]:
    """(parameters, process group) whose gradients are summed before the step
    (see [Note: gradient sums before the step]), in module order; the same
    list, in the same order, on every rank of each group."""
    sequence = [p for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.requires_grad]
    out = [(sequence, mesh.group("model"))] if sequence and mesh.size("model") > 1 else []
    by_group: dict[tuple[int, ...], tuple[list, object]] = {}
    for p in module.parameters():
        replica = getattr(p, "tp_replica_group", None)
        if replica is not None and replica.size > 1 and p.requires_grad:
            by_group.setdefault(replica.ranks, ([], replica.group))[0].append(p)
    return out + list(by_group.values())


def attach_model_parallel(module: torch.nn.Module, mesh: ParallelMesh, strategy: GradientStrategy,
                          register_pre_step_hook: Callable[[Callable[[], None]], None]) -> None:
    """Tell `strategy` the ranks holding the rest of the model (StageSpan
    over pipe_model when it has > 1 rank) and register, through
    `register_pre_step_hook`, the gradient sums of [Note: gradient sums
    before the step]. Call once, before the first backward; does nothing
    for a model held whole by every rank."""
    span = model_parallel_span(module, mesh)
    if span is not None:
        strategy.span_stages(span)
    sums = partial_gradient_groups(module, mesh)
    if sums:
        def sum_partial_gradients() -> None:
            for params, group in sums:
                strategy.sum_gradients_across(params, group)
        register_pre_step_hook(sum_partial_gradients)

"""DeepSpeed's `deepspeed.tp_model_init`: automatic tensor parallelism
(dsrun/runtime/parallel/tensor/autotp.py) of a plain model or of one built
under `zero.Init` (dsrun/runtime/zero/tensor_parallel.py).

It sits with the engine because it needs both: the tensor-parallel layers
read a zero.Init model's full tensors through ZERO_INIT (see [Note: full
tensors] in runtime/parallel/tensor/full.py), and ZeRO partitions the
sharded model over the data axis afterwards; neither of those packages
imports the other's side of it. `initialize` (compose.py) applies the same
steps to the mesh it owns, through `plan_autotp` and `apply_autotp`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsrun.runtime import comm
from dsrun.runtime.distributed.dist import init_distributed
from dsrun.runtime.parallel.mesh import ParallelMesh, current, set_current
from dsrun.runtime.parallel.tensor.autotp import placement_plan, shard_model
from dsrun.runtime.parallel.tensor.vocab import VocabPlan, plan_vocabulary, shard_vocabulary
from dsrun.runtime.zero.init import is_partitioned
from dsrun.runtime.zero.tensor_parallel import ZERO_INIT, built_partitioned, model_placement, partition_over_data


@dataclass(frozen=True)
class AutoTPPlan:
    """What plan_autotp checked: the vocabulary layers to split (None: not
    asked, or one tensor rank) and whether the model was built under
    zero.Init."""

    vocab: VocabPlan | None
    partitioned: bool


def plan_autotp(model: nn.Module, tp_size: int, vocab_parallel: bool = False) -> AutoTPPlan:
    """Check that `model` can be sharded over `tp_size` ranks, from the full
    shapes alone; changes nothing, communicates nothing.

    Raises:
        ValueError: a layer no rule places (named), an embedding
            vocab_parallel cannot split (named), a zero.Init model
            partitioned over fewer ranks than the world.
    """
    placement_plan(model)  # an unplaceable layer fails before anything changes
    vocab = plan_vocabulary(model, tp_size, ZERO_INIT) if vocab_parallel and tp_size > 1 else None
    return AutoTPPlan(vocab, built_partitioned(model))


def apply_autotp(model: nn.Module, plan: AutoTPPlan, mesh: ParallelMesh, device: torch.device,
                 dtype: torch.dtype | None = None) -> nn.Module:
    """Shard `model` in place over `mesh`'s model axis (see tp_model_init),
    as checked by `plan`: the full model broadcast from global rank 0
    (through `device`, the backend's), each layer cut by name, the
    vocabulary layers split when planned, a zero.Init model partitioned
    again over the data axis; marks it `ds_autotp_parsed`. Collective over
    the job.

    Raises:
        ValueError: heads or widths the model axis cannot split (named).
    """
    with torch.no_grad():  # zero.Init shards already hold rank 0's values
        for tensor in [p for p in model.parameters() if not is_partitioned(p)] + list(model.buffers()):
            on_device = tensor.data.to(device)  # the backend's device (NCCL: cuda)
            comm.broadcast(on_device, src=0)
            tensor.data.copy_(on_device)
    placement = model_placement(model) if plan.partitioned else None
    shard_model(model, mesh, dtype, ZERO_INIT)
    if plan.vocab is not None:
        shard_vocabulary(plan.vocab, mesh, dtype, ZERO_INIT)
        model.ds_autotp_vocab_parallel = True
    if plan.partitioned and mesh.size("model") > 1:
        partition_over_data(model, mesh.axis_group("data"), placement, dtype)
    model.ds_autotp_parsed = True
    return model


def tensor_parallel_mesh(tp_size: int) -> ParallelMesh:
    """The job's mesh with a model axis of `tp_size`: the declared one
    (`current()`, see [Note: the declared mesh] in runtime/parallel/mesh.py)
    when it already has it, else a new data x model mesh made current
    (collective)."""
    mesh = current()
    if mesh.size("model") == tp_size:
        return mesh
    mesh = ParallelMesh.build(comm.get_world_size(), model=tp_size)
    set_current(mesh)
    return mesh


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype | None = None,
                  vocab_parallel: bool = False) -> nn.Module:
    """DeepSpeed's `deepspeed.tp_model_init`: shard `model` in place over
    `tp_size` tensor-parallel ranks (see [Note: which layer goes where] in
    runtime/parallel/tensor/autotp.py). Call on every rank after
    `dsrun.init_distributed()` (or under the launcher, which it
    initialises), before `dsrun.initialize`, which then trains it over the
    data axis. Broadcasts the full model from global rank 0 first ([Note:
    sharding from one full model]; a zero.Init model's shards already hold
    rank 0's values and only its buffers and any parameter built outside
    zero.Init are broadcast); makes the data x model mesh current (so
    `dsrun.utils.groups` answers the tensor-parallel group); marks the
    model `ds_autotp_parsed` as DeepSpeed does.

    Args:
        model: a Hugging Face GPT-2 / Llama / Mistral-style model or
            examples/gpt_model.py's GPT, on any device.
        tp_size: tensor-parallel degree; must divide the world size.
        dtype: cast the model to this dtype (None: keep).
        vocab_parallel: also split the input embedding and the output
            layer by vocabulary (see runtime/parallel/tensor/vocab.py
            [Note: vocabulary-parallel embedding and output layer]); marks
            the model `ds_autotp_vocab_parallel`.

    A model built under `dsrun.zero.Init()` is sharded without its full
    weights ever existing on one rank, and left partitioned over the data
    axis (see runtime/zero/tensor_parallel.py [Note: tensor parallelism of
    a zero.Init model]).

    Returns:
        `model` itself, sharded.

    Raises:
        ValueError: tp_size < 1 or not dividing the world size, a layer no
            rule places (named), heads that tp_size cannot split, an
            embedding vocab_parallel cannot split (named), a zero.Init
            model partitioned over fewer ranks than the world; all before
            anything changes.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size={tp_size!r}; give a positive integer")
    if getattr(model, "ds_autotp_parsed", False):
        raise ValueError("tp_model_init: this model is already sharded (ds_autotp_parsed); call it once")
    device = init_distributed().device
    world = comm.get_world_size()
    if world % tp_size:
        raise ValueError(f"tp_model_init: tp_size={tp_size} does not divide the world size {world}")
    plan = plan_autotp(model, tp_size, vocab_parallel)
    return apply_autotp(model, plan, tensor_parallel_mesh(tp_size), device, dtype)

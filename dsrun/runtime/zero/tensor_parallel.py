"""Automatic tensor parallelism of a model built under `zero.Init`: the
parameters' full tensors for AutoTP (ZeroInitTensors, see [Note: full
tensors] in dsrun/runtime/parallel/tensor/full.py) and their partition
over the data axis afterwards.

[Note: tensor parallelism of a zero.Init model]
A model built inside `with dsrun.zero.Init():` holds, on each rank, only its
ZeRO shard of every parameter (1/N of the flattened tensor, N = every rank;
see dsrun/runtime/zero/init.py), with the values the plain model would have
after the same seed (rank 0's, bit for bit). tp_model_init shards such a
model without ever holding its full weights on one rank:

1. The placement is planned from the shapes alone (`ds_shape`), so a layer
   it cannot place or split fails before anything changes.
2. One linear layer at a time, the layer's full weight (and bias) is
   gathered from the zero.Init shards (one all-gather over every rank), this
   rank's tensor-parallel slice is cut from it exactly as for a plain model
   (parallel/tensor/autotp.py, reading it through ZERO_INIT), and the old
   layer, with its shards, is dropped.
3. Every parameter is then partitioned again over the data axis only, as
   ZeRO shards a tensor-parallel model: a tensor-parallel slice over the
   data ranks of its model rank, a replicated parameter (embeddings,
   LayerNorm, the output layer) gathered one at a time and split likewise.
   Its zero.Init record then says "partitioned over the data axis", which
   is the layout the ZeRO-3 strategy adopts without a gather (stages 0-2
   gather each one back over the data axis, one at a time).

So each rank ends with 1/(tp x dp) of each split weight and 1/dp of each
replicated one, and at no point holds more than that plus the full value of
the largest one parameter (twice: the gathered value and the layer built
from it), the same bound as zero.Init's own construction. The values are
the slices of the plain model built from the same seed: nothing is drawn
again. The gather of step 2 is chosen over a gather-free exchange of
exactly the needed elements (an all-to-all from the flat ZeRO shards)
because its peak is already bounded by one parameter and it reuses the
plain path's slicing, the only place the fused q/k/v and replicated
key/value layouts are written down.

Requirements: the model was built under zero.Init over every rank (the
default `data_parallel_group`), since the slices are gathered over the
world; a parameter shared between two modules (tied embeddings) is
repartitioned once.
"""
from __future__ import annotations

import torch
from torch import nn

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import MeshGroup, torch_group
from dsrun.runtime.parallel.tensor.full import FullTensors
from dsrun.runtime.zero.init import Placement, gather_full, is_partitioned, partition_param
from dsrun.runtime.zero.params import record_of


def built_partitioned(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a zero.Init shard (see [Note:
    tensor parallelism of a zero.Init model]).

    Raises:
        ValueError: one was partitioned over fewer ranks than the world
            (zero.Init with a data_parallel_group), which tp_model_init
            cannot gather from.
    """
    world = comm.get_world_size()
    found = False
    for name, p in model.named_parameters():
        if is_partitioned(p):
            found = True
            if record_of(p).init_world_size != world:
                raise ValueError(f"tp_model_init: parameter {name!r} was built under zero.Init over "
                                 f"{record_of(p).init_world_size} ranks, not the job's {world}; build the "
                                 "model under zero.Init() without data_parallel_group (tp_model_init "
                                 "partitions it over the data axis itself)")
    return found


class ZeroInitTensors(FullTensors):
    """Full tensors of a model built under zero.Init or not: a zero.Init
    shard's recorded shape and gathered value, a plain parameter's own."""

    def shape(self, param: torch.Tensor) -> torch.Size:
        """The full shape of a parameter, zero.Init-partitioned or not."""
        return record_of(param).shape if is_partitioned(param) else param.shape

    def value(self, param: torch.Tensor) -> torch.Tensor:
        """The full value of `param`, detached: gathered over every rank for a
        zero.Init shard (collective; a new tensor), the parameter's own data
        otherwise."""
        if is_partitioned(param):
            return gather_full(param)
        return param.detach()


ZERO_INIT = ZeroInitTensors()


def model_placement(model: nn.Module) -> Placement:
    """The zero.Init placement `model` was built with (read from one of its
    shards): where full values are built and where shards live.

    Raises:
        ValueError: no parameter of `model` is a zero.Init shard.
    """
    for p in model.parameters():
        if is_partitioned(p):
            rec = record_of(p)
            return Placement(rec.init_device, rec.init_shard.device, pin=rec.init_shard.is_pinned())
    raise ValueError("tp_model_init: no zero.Init parameter in the model")


def partition_over_data(model: nn.Module, data: MeshGroup, placement: Placement,
                        dtype: torch.dtype | None) -> None:
    """Partition every parameter of `model` over the data axis `data` (step 3
    of [Note: tensor parallelism of a zero.Init model]), one at a time,
    casting floating-point ones to `dtype` first (None: keep). Collective
    over the job."""
    with torch.no_grad():
        for p in model.parameters():
            full = ZERO_INIT.value(p)
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            p.data = full.to(placement.build)
            rec = record_of(p)
            if rec is not None:  # its shard was over every rank: take the new value
                rec.init_full = True
            partition_param(p, placement, torch_group(data))


"""Per-rank memory: what ZeRO predicts and what a rank actually holds.

[Note: ZeRO memory formulas]
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC20), sections 3-5: with Ψ parameters, N data-parallel
ranks, 2-byte parameters and gradients and K bytes of optimizer state per
parameter (K = 12 for mixed-precision Adam: fp32 master, momentum,
variance), one rank holds

    stage 0: (2 + 2 + K) Ψ            = 16 Ψ
    stage 1:  2 Ψ + 2 Ψ + K Ψ / N     = 4 Ψ + 12 Ψ / N
    stage 2:  2 Ψ + (2 + K) Ψ / N     = 2 Ψ + 14 Ψ / N
    stage 3: (2 + 2 + K) Ψ / N        = 16 Ψ / N   (+ the live working set)

With offload (Ren et al., ZeRO-Offload, ATC 2021; Rajbhandari et al.,
ZeRO-Infinity, SC21) the same bytes move to another tier: offload_optimizer
cpu puts master and optimizer states in host memory, nvme in swap files,
and at stage 2 and 3 the averaged gradient partitions in host memory (the
step reads them there; stage 0 and 1 accumulate into a full gradient buffer
beside the parameters, which stays on the device);
offload_param (stage 3) does the same with the 16-bit partitions. NVMe
offload adds host streaming buffers (buffer_count x 3 x 4 bytes x
sub_group_size for the optimizer). `MemoryEstimate.tiers()` splits the
total into device, host and NVMe bytes (on a CPU-only machine device and
host are both the rank's RAM).

`estimate_zero_memory` evaluates the same terms with the actual element sizes
(fp32 training keeps no separate master copy, so K = 8 for Adam; gradients
use data_types.grad_accum_dtype, fp32 by default) and with the padding that
dsrun's flat buffers add (each bucket is padded to a multiple of N), so that
its result equals `Engine.memory_breakdown()` for the persistent buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.float64: "fp64", torch.int64: "int64", torch.int32: "int32",
               torch.int8: "int8"}
CATEGORIES = ("params", "grads", "master", "optimizer_states")


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes per rank for the persistent ZeRO buffers.

    Each category maps dtype name -> bytes. `total` is the sum. Stage 3's
    live working set (gathered units, persistent small parameters, in-flight
    buckets) is reported separately in `working_set` and not in `total`.
    `placement` maps a category to "device", "host" or "nvme" (missing:
    device); see `tiers`.
    """

    stage: int
    world_size: int
    num_params: int
    categories: dict[str, dict[str, int]]
    working_set: int = 0
    placement: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(sum(d.values()) for d in self.categories.values())

    def tiers(self) -> dict[str, int]:
        """Bytes per rank in device memory, host memory and NVMe swap files
        (the working set counts as device memory)."""
        out = {"device": self.working_set, "host": 0, "nvme": 0}
        for cat, d in self.categories.items():
            out[self.placement.get(cat, "device")] += sum(d.values())
        return out

    def bytes_per_param(self) -> float:
        """Total bytes / Ψ (16 for stage 0 mixed Adam, 16/N for stage 3, ...)."""
        return self.total / self.num_params


def _num_and_padded(model_or_num_params, world_size: int, bucket_numel: int | None):
    """Ψ and the padded element count of dsrun's flat buffers for it."""
    from dsrun.runtime.zero.partition import FlatLayout

    if isinstance(model_or_num_params, torch.nn.Module):
        params = [p for p in model_or_num_params.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        layout = FlatLayout.build([(str(i), p.shape) for i, p in enumerate(params)],
                                  world_size, bucket_numel)
        return layout.numel, layout.padded_numel
    n = int(model_or_num_params)
    if n < 1:
        raise ValueError(f"number of parameters must be >= 1, got {model_or_num_params!r}")
    if bucket_numel is None:
        return n, -(-n // world_size) * world_size
    layout = FlatLayout.build([(str(i), (min(bucket_numel, n - i),)) for i in range(0, n, bucket_numel)],
                              world_size, bucket_numel)
    return n, layout.padded_numel


def estimate_zero_memory(model_or_num_params, world_size: int, stage: int, dtype: str = "bf16",
                         grad_accum_dtype: str | None = None, optimizer_states: int = 2,
                         bucket_numel: int | None = None, padded_numel: int | None = None,
                         working_set_numel: int = 0, offload_optimizer: str = "none",
                         offload_param: str = "none", sub_group_size: int = 1_000_000_000,
                         buffer_count: int = 4, hpz_partition_size: int = 1, frozen_numel: int = 0,
                         quantized_nontrainable_weights: bool = False) -> MemoryEstimate:
    """Predict the persistent per-rank bytes of ZeRO stage 0-3.

    model_or_num_params: an nn.Module (its trainable parameters) or Ψ.
    world_size: N, data-parallel ranks. stage: 0..3. dtype: compute dtype
    ("fp32", "bf16", "fp16"). grad_accum_dtype: gradient dtype; None means
    fp32 (dsrun's default).
    optimizer_states: fp32 tensors of state per parameter (Adam 2, SGD with
    momentum 1). bucket_numel: dsrun's bucket size (reduce_bucket_size),
    which sets the padding; padded_numel: give the padded size directly
    (e.g. the sum over stage-3 units). working_set_numel: elements of the
    stage-3 live set (reported apart). offload_optimizer, offload_param:
    "none", "cpu" or "nvme" (ds_config's offload devices; parameters only at
    stage 3); sub_group_size and buffer_count size the NVMe optimizer's
    host buffers (category "offload_buffers").
    hpz_partition_size: ZeRO++ hpZ's h (stage 3): each rank also keeps a
    secondary 1/h of the gathered units in the compute dtype (category
    "hpz_secondary", as memory_breakdown names it; padded_numel should then
    cover the non-persistent units only, which are the ones that have one).
    frozen_numel: elements of frozen (requires_grad=False) parameters, which
    stage 3 partitions with the others into "params" (below stage 3 they
    stay whole module parameters outside ZeRO's buffers and are not
    counted), padded as one bucket (stage 3 pads each parameter to a
    multiple of N: up to N - 1 elements more per parameter);
    quantized_nontrainable_weights keeps their shards as int8 in blocks of
    256 with an fp32 scale each (ZeRO++; up to one block more per unit).

    Raises ValueError for an unknown dtype, stage or offload device, N < 1,
    parameter offload, hpZ or int8 frozen weights below stage 3, or an h
    that does not divide N.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for name in (dtype, grad_accum_dtype):
        if name is not None and name not in _BYTES:
            raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_BYTES)}")
    for what, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f"{what} must be none, cpu or nvme, got {device!r}")
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param needs stage 3, got stage {stage}")
    if (hpz_partition_size > 1 or quantized_nontrainable_weights) and stage != 3:
        raise ValueError(f"hpz_partition_size > 1 and quantized_nontrainable_weights need stage 3, got stage {stage}")
    if hpz_partition_size < 1 or world_size % hpz_partition_size:
        raise ValueError(f"hpz_partition_size must divide world_size {world_size}, got {hpz_partition_size}")
    psi, padded = _num_and_padded(model_or_num_params, world_size, bucket_numel)
    if padded_numel is not None:
        padded = padded_numel
    shard = padded // world_size
    grad_name = grad_accum_dtype or "fp32"
    mixed = dtype != "fp32"
    if stage == 0:
        params, grads, master, states = psi, psi, psi, psi
    else:
        params = padded if stage < 3 else shard
        # Stage 1 keeps the full accumulation buffer (its own shard is the reduced one).
        grads = padded if stage == 1 else shard
        master, states = shard, shard
    cats = {
        "params": {dtype: params * _BYTES[dtype]},
        "grads": {grad_name: grads * _BYTES[grad_name]},
        "master": {"fp32": master * 4} if mixed else {},
        "optimizer_states": {"fp32": states * 4 * optimizer_states} if optimizer_states else {},
    }
    tier_of = {"cpu": "host", "nvme": "nvme"}
    placement = {}
    if offload_optimizer != "none":
        placement.update(master=tier_of[offload_optimizer], optimizer_states=tier_of[offload_optimizer])
        if stage >= 2:  # the gradient partitions go where the step runs (OptimizerTier.grad_device)
            placement["grads"] = "host"
        if offload_optimizer == "nvme" and optimizer_states:
            per_buffer = 3 * 4 * min(int(sub_group_size), shard)
            cats["offload_buffers"] = {"fp32": int(buffer_count) * per_buffer}
            placement["offload_buffers"] = "host"
    if offload_param != "none":
        placement["params"] = tier_of[offload_param]
    if stage == 3 and frozen_numel:
        frozen_shard = -(-int(frozen_numel) // world_size)
        if quantized_nontrainable_weights:  # int8 codes + 4 bytes of scale per block (comm/quantized.py)
            blocks = -(-frozen_shard // 256)
            cats["params"]["int8"] = blocks * 256 + 4 * blocks
        else:
            cats["params"][dtype] += frozen_shard * _BYTES[dtype]
    if hpz_partition_size > 1:
        cats["hpz_secondary"] = {dtype: padded // hpz_partition_size * _BYTES[dtype]}
    return MemoryEstimate(stage, world_size, psi, cats, working_set_numel * _BYTES[dtype], placement)


def tensor_breakdown(held: Mapping[str, Iterable[torch.Tensor]]) -> dict[str, dict[str, int]]:
    """Bytes actually held, per category and dtype name.

    held: category -> tensors. A tensor is counted by its whole storage (so
    the padding of a flat buffer counts) and each storage once, even when
    several views of it are listed.
    """
    seen: set[int] = set()
    out: dict[str, dict[str, int]] = {}
    for category, tensors in held.items():
        per_dtype = out.setdefault(category, {})
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            name = DTYPE_NAMES.get(t.dtype, str(t.dtype))
            per_dtype[name] = per_dtype.get(name, 0) + storage.nbytes()
    return out

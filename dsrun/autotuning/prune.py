"""Which candidates cannot fit: ZeRO's memory formulas plus what the baseline trial measured.

[Note: the tuner's memory model]
A rank's peak memory for a candidate c is predicted as

    fixed + persistent(c) + per_sample x micro_batch(c)

persistent(c) is `estimate_zero_memory` for c (parameters, gradients, fp32
master and optimizer states after ZeRO's partitioning and offload; see
[Note: ZeRO memory formulas] in dsrun/runtime/memory/accounting.py). The
other two terms come from the baseline trial (the user's own config): its
memory when the engine was built, minus its own persistent estimate, is
`fixed` (the framework, the model's own tensors, buffers); its peak minus
that base memory, per sample of its micro-batch, is `per_sample`
(activations and whatever else the step allocates; it includes optimizer
state created lazily at the first step, so the model errs on the side of
too much, and a candidate it keeps may still fail: the trial then says so).

The budget is what the ranks' machines reported in the baseline trial,
times `HEADROOM`: on an accelerator each rank's device tier must fit its
device and the host tier of all ranks of a node the node's available RAM;
on a CPU-only machine device and host are the same RAM, so the whole
prediction of all ranks of a node must fit it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsrun.autotuning.results import TrialResult
from dsrun.autotuning.space import Candidate
from dsrun.runtime.memory.accounting import estimate_zero_memory

HEADROOM = 0.9  # share of the reported memory a prediction may use
_GIB = 2**30


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes a candidate may use: per rank on its device, per node in host RAM.

    accelerator: False on a CPU-only machine (then `device_per_rank` is unused
    and every byte counts against `host_per_node`).
    """

    device_per_rank: int
    host_per_node: int
    ranks_per_node: int
    accelerator: bool

    @classmethod
    def from_result(cls, result: TrialResult, headroom: float = HEADROOM) -> MemoryBudget:
        """The budget of the machines that ran `result`: the smallest figures any rank reported.

        Host RAM available at start is what the node had left with the
        baseline's ranks already started; on CPU their base memory is added back.
        """
        accelerator = result.device != "cpu"
        host = min(result.host_available)
        if not accelerator:  # the baseline's own ranks already held their base memory in RAM
            host += result.ranks_per_node * max(result.base_memory)
        return cls(int(min(result.device_total) * headroom), int(host * headroom), result.ranks_per_node, accelerator)


def precision(base: dict[str, Any]) -> str:
    """The compute dtype name a config trains in: bf16, fp16 or fp32."""
    for key in ("bf16", "bfloat16"):
        if isinstance(base.get(key), dict) and base[key].get("enabled"):
            return "bf16"
    if isinstance(base.get("fp16"), dict) and base["fp16"].get("enabled"):
        return "fp16"
    return "fp32"


def optimizer_states(base: dict[str, Any]) -> int:
    """fp32 state tensors per parameter of the config's optimizer: SGD 1 (momentum), others 2 (Adam-like)."""
    optimizer = base.get("optimizer")
    name = str(optimizer.get("type", "")).lower() if isinstance(optimizer, dict) else ""
    return 1 if name == "sgd" else 2


@dataclass(frozen=True)
class MemoryModel:
    """Predicts a candidate's peak bytes per rank (see [Note: the tuner's memory model])."""

    num_params: int
    dp_size: int
    dtype: str
    optimizer_states: int
    fixed: int
    per_sample: int

    @classmethod
    def from_baseline(cls, result: TrialResult, baseline: Candidate, base: dict[str, Any],
                      dp_size: int) -> MemoryModel:
        """Fit `fixed` and `per_sample` to the baseline trial `result`, which ran setting `baseline`."""
        model = cls(result.num_params, dp_size, precision(base), optimizer_states(base), 0, 0)
        persistent = model.persistent(baseline)
        base_mem = max(result.base_memory)
        own = persistent["device"] + (0 if result.device != "cpu" else persistent["host"])
        fixed = max(0, base_mem - own)
        per_sample = max(0, result.peak - base_mem) // baseline.micro_batch
        return cls(model.num_params, dp_size, model.dtype, model.optimizer_states, fixed, per_sample)

    def persistent(self, c: Candidate) -> dict[str, int]:
        """estimate_zero_memory's bytes per rank for `c`, by tier (device, host, nvme)."""
        estimate = estimate_zero_memory(self.num_params, self.dp_size, c.stage, dtype=self.dtype,
                                        optimizer_states=self.optimizer_states, bucket_numel=c.reduce_bucket_size,
                                        offload_optimizer=c.offload_optimizer)
        return estimate.tiers()

    def predict(self, c: Candidate) -> dict[str, int]:
        """Predicted peak bytes per rank of `c`: {"device": ..., "host": ...}."""
        tiers = self.persistent(c)
        return {"device": self.fixed + tiers["device"] + self.per_sample * c.micro_batch, "host": tiers["host"]}


def prune(candidates: list[Candidate], model: MemoryModel,
          budget: MemoryBudget) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """Split `candidates` into those predicted to fit and those ruled out, each with the reason.

    Order is kept in both lists.
    """
    fits, ruled_out = [], []
    for c in candidates:
        need = model.predict(c)
        if budget.accelerator:
            device_over = need["device"] > budget.device_per_rank
            host_over = need["host"] * budget.ranks_per_node > budget.host_per_node
            if device_over:
                ruled_out.append((c, (f"needs ~{need['device'] / _GIB:.2f} GiB of device memory per rank, "
                                      f"{budget.device_per_rank / _GIB:.2f} GiB usable")))
                continue
            if host_over:
                ruled_out.append((c, (f"needs ~{need['host'] * budget.ranks_per_node / _GIB:.2f} GiB of host "
                                      f"memory per node, {budget.host_per_node / _GIB:.2f} GiB usable")))
                continue
        else:
            total = (need["device"] + need["host"]) * budget.ranks_per_node
            if total > budget.host_per_node:
                ruled_out.append((c, (f"needs ~{total / _GIB:.2f} GiB of RAM per node "
                                      f"({budget.ranks_per_node} ranks), {budget.host_per_node / _GIB:.2f} GiB usable")))
                continue
        fits.append(c)
    return fits, ruled_out

"""The candidate settings of a tuning run, and the trial config each one makes.

A `Candidate` is one point of the search space: ZeRO stage, micro-batch size
with its gradient accumulation, optimizer offload, and (fast=false) the
reduce/all-gather bucket sizes; activation checkpointing is a dimension only
when `arg_mappings` names the script flag that switches it (a config key
cannot make a script checkpoint its layers). `generate` lists every candidate
the config's `autotuning` section allows, in grid order; `spread` keeps
`num_tuning_micro_batch_sizes` micro-batch sizes per setting among those the
memory model let through (prune.py).
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, replace
from typing import Any

from dsrun.runtime.config.sections import AutotuningConfig

# Bucket sizes (elements) tried with fast=false: DeepSpeed's default 5e8 and a tenth of it.
BUCKET_SIZES = (50_000_000, 500_000_000)
AC_KEY = "activation_checkpointing"  # arg_mappings key of the script's checkpointing flag


@dataclass(frozen=True, order=True)
class Candidate:
    """One setting to try. micro_batch x grad_accum x data-parallel ranks is the global batch.

    Bucket sizes are elements (None: the base config's); activation_checkpointing
    None means the script's own choice (not tuned).
    """

    stage: int
    micro_batch: int
    grad_accum: int
    offload_optimizer: str = "none"
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    activation_checkpointing: bool | None = None

    @property
    def name(self) -> str:
        """A short unique id, also the trial's directory name: e.g. ``z2_mbs4_gas2_cpu``."""
        parts = [f"z{self.stage}", f"mbs{self.micro_batch}", f"gas{self.grad_accum}"]
        if self.offload_optimizer != "none":
            parts.append(self.offload_optimizer)
        if self.reduce_bucket_size is not None:
            parts.append(f"rb{self.reduce_bucket_size:.0e}".replace("+", ""))
        if self.allgather_bucket_size is not None:
            parts.append(f"ag{self.allgather_bucket_size:.0e}".replace("+", ""))
        if self.activation_checkpointing is not None:
            parts.append("ac" if self.activation_checkpointing else "noac")
        return "_".join(parts)

    def describe(self) -> str:
        """The setting as a reader wants it: ``ZeRO 2, micro-batch 4 x 2, offload cpu``."""
        text = f"ZeRO {self.stage}, micro-batch {self.micro_batch} x {self.grad_accum}"
        if self.offload_optimizer != "none":
            text += f", offload {self.offload_optimizer}"
        if self.reduce_bucket_size is not None:
            text += f", reduce bucket {self.reduce_bucket_size:.0e}"
        if self.allgather_bucket_size is not None:
            text += f", allgather bucket {self.allgather_bucket_size:.0e}"
        if self.activation_checkpointing is not None:
            text += ", act. ckpt " + ("on" if self.activation_checkpointing else "off")
        return text

    def apply(self, base: dict[str, Any], dp_size: int) -> dict[str, Any]:
        """The trial config: `base` (not modified) with this setting and autotuning.enabled true.

        All three batch keys are written, consistent for `dp_size` data-parallel ranks.
        """
        cfg = copy.deepcopy(base)
        cfg["train_micro_batch_size_per_gpu"] = self.micro_batch
        cfg["gradient_accumulation_steps"] = self.grad_accum
        cfg["train_batch_size"] = self.micro_batch * self.grad_accum * dp_size
        zero = cfg.get("zero_optimization")
        zero = dict(zero) if isinstance(zero, dict) else {}
        zero["stage"] = self.stage
        offload = dict(zero.get("offload_optimizer") or {})
        offload["device"] = self.offload_optimizer
        zero["offload_optimizer"] = offload
        if self.reduce_bucket_size is not None:
            zero["reduce_bucket_size"] = self.reduce_bucket_size
        if self.allgather_bucket_size is not None:
            zero["allgather_bucket_size"] = self.allgather_bucket_size
        cfg["zero_optimization"] = zero
        cfg["autotuning"] = {**(cfg.get("autotuning") or {}), "enabled": True}
        return cfg


def base_candidate(base: dict[str, Any], dp_size: int, micro_batch: int, grad_accum: int) -> Candidate:
    """The setting the user's own config runs with (for the baseline trial)."""
    zero = base.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {"stage": 1 if zero is True else 0}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    return Candidate(int(zero.get("stage", 0)), micro_batch, grad_accum, offload or "none")


def micro_batch_sizes(low: int, high: int) -> list[int]:
    """Powers of two from `low` to `high`, both ends included: micro_batch_sizes(3, 20) == [3, 4, 8, 16, 20]."""
    sizes = {low, high}
    power = 1
    while power <= high:
        if power >= low:
            sizes.add(power)
        power *= 2
    return sorted(sizes)


def generate(tuning: AutotuningConfig, base: dict[str, Any], dp_size: int,
             offload_devices: tuple[str, ...] = ("none",)) -> list[Candidate]:
    """Every candidate the `autotuning` section allows, in grid order (stage, offload, ..., micro-batch).

    A fixed `train_batch_size` in `base` is kept: a micro-batch size that does
    not divide it over `dp_size` ranks is left out, and gradient accumulation
    makes up the rest. Otherwise the base's gradient accumulation (default 1)
    is kept and the global batch follows, up to `max_train_batch_size`.
    offload_devices: optimizer offload devices to try (stage >= 1 only); "cpu"
    makes sense only where the ranks compute on an accelerator.
    """
    fixed = base.get("train_batch_size")
    fixed = fixed if isinstance(fixed, int) and not isinstance(fixed, bool) else None
    gas_given = base.get("gradient_accumulation_steps")
    gas_given = gas_given if isinstance(gas_given, int) and not isinstance(gas_given, bool) else 1
    batches: list[tuple[int, int]] = []
    for mbs in micro_batch_sizes(tuning.min_train_micro_batch_size_per_gpu, tuning.max_train_micro_batch_size_per_gpu):
        if fixed is not None:
            if fixed % (mbs * dp_size):
                continue
            gas = fixed // (mbs * dp_size)
        else:
            gas = gas_given
        if tuning.max_train_batch_size is not None and mbs * gas * dp_size > tuning.max_train_batch_size:
            continue
        batches.append((mbs, gas))
    buckets: list[int | None] = [None] if tuning.fast else list(BUCKET_SIZES)
    ac: list[bool | None] = [False, True] if AC_KEY in (tuning.arg_mappings or {}) else [None]
    out = []
    for stage in range(4):
        offloads = ["none"] + [d for d in offload_devices if d != "none" and stage >= 1]
        for offload, ckpt, reduce, gather in itertools.product(offloads, ac, buckets, buckets):
            if stage == 0 and (reduce, gather) != (buckets[0], buckets[0]):
                continue  # stage 0 has no ZeRO buckets to tune
            out += [Candidate(stage, mbs, gas, offload, reduce if stage else None, gather if stage else None, ckpt)
                    for mbs, gas in batches]
    return out


def spread(candidates: list[Candidate], count: int) -> list[Candidate]:
    """Keep at most `count` micro-batch sizes per setting, evenly spaced and always the largest.

    Candidates that differ only in micro-batch size (and accumulation) form one
    setting; the order of `candidates` is kept.
    """
    groups: dict[Candidate, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(replace(c, micro_batch=0, grad_accum=0), []).append(c)
    keep: set[Candidate] = set()
    for members in groups.values():
        members = sorted(members, key=lambda c: c.micro_batch)
        if len(members) <= count:
            keep.update(members)
            continue
        last = len(members) - 1
        step = last / (count - 1) if count > 1 else 0
        keep.update(members[last - round(i * step)] for i in range(count))
    return [c for c in candidates if c in keep]

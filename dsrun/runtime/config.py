"""The ds_config schema: typed, strict, with errors a user can act on.

Every key of DeepSpeed's JSON config that dsrun understands is a field of a
pydantic model below, named exactly as in DeepSpeed, with DeepSpeed's
default and a description. `load_config` is the one entry point:

    cfg = load_config("ds_config.json", world_size=2)   # or a dict, .yaml, DsConfig
    cfg.train_batch_size, cfg.zero_optimization.stage, ...

It reads the source, rejects unknown keys (naming the closest valid one),
translates pydantic's errors into one line per problem, resolves the batch
triple for the given world size, and finally rejects features this release
does not implement through one registry, `NOT_YET_SUPPORTED`. All problems
found are raised together as one `ConfigError`.

[Note: order of the checks]
The checks run in three phases, each collecting every problem it finds:
(1) reading the file, finding "auto" placeholders and applying DeepSpeed's
forms (see [Note: DeepSpeed's forms and foreign keys]), (2) pydantic
validation of all sections, which reports unknown keys, wrong types, bad
values and the checks inside one section (e.g. NVMe offload without a
path), together with the batch-triple arithmetic, which only needs the three
batch keys; the checks across sections (fp16 with bf16) run in this phase
once every section is valid; (3) `NOT_YET_SUPPORTED`, on the valid config.
A later phase runs only when the earlier ones found nothing, so that no
message is a consequence of another one; the one exception is
NOT_YET_SUPPORTED, which is also checked on the raw values when phase 2
failed, so that a config's unsupported settings are reported in the same
round as its other problems.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
import re
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Literal, Optional, Union

import annotated_types as at
import torch
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

__all__ = [
    "ConfigError",
    "ConfigWarning",
    "DsConfig",
    "NO_EFFECT_YET",
    "NOT_YET_SUPPORTED",
    "Unsupported",
    "load_config",
    "resolve_batch_triple",
]

_RELEASE = "dsrun 0.1"


class ConfigError(ValueError):
    """A ds_config that cannot be used, with every problem found in it.

    `ConfigError("optimizer.params.lr: must be > 0, got -1")` is one problem
    and reads as just that line; with several problems or a `source`, the
    message is a header naming the source, then one problem per line.

    Attributes:
        problems: one line per problem, each starting with the dotted key
            path it is about, saying what was wrong and how to fix it.
        source: where the config came from (a file path, "dict"), or None.
    """

    def __init__(self, *problems: str, source: str | None = None):
        self.problems = list(problems)
        self.source = source
        if source is None and len(self.problems) == 1:
            super().__init__(self.problems[0])
            return
        count = len(self.problems)
        where = f" ({source})" if source else ""
        head = f"invalid dsrun config{where}: {count} problem{'s' if count != 1 else ''}"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))

    def __reduce__(self):  # keep it picklable, e.g. to report a rank's failure to another process
        return functools.partial(type(self), source=self.source), tuple(self.problems)


class _Problem(ValueError):
    """Raised by validators below with a message already written for the user.

    `key`, when given, is the field of the validated model the message is
    about; the translation of pydantic errors appends it to the key path.
    """

    def __init__(self, text: str, key: str | None = None):
        super().__init__(text)
        self.text = text
        self.key = key


# ---------------------------------------------------------------------------
# Value types. Numbers reject booleans (pydantic would read `true` as 1) and,
# through pydantic's lax mode, accept integral floats such as 5e8 for ints.


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


_NUMBER = BeforeValidator(_not_bool)
Int = Annotated[int, _NUMBER]
PosInt = Annotated[int, _NUMBER, at.Ge(1)]
Count = Annotated[int, _NUMBER, at.Ge(0)]  # sizes in elements, thresholds
NonNegReal = Annotated[float, _NUMBER, at.Ge(0.0)]
PosReal = Annotated[float, _NUMBER, at.Gt(0.0)]
Device = Literal["none", "cpu", "nvme"]


class _Section(BaseModel):
    """Base of every config section: strict keys, old key names accepted.

    `_ALIASES` maps an old or alternative DeepSpeed key name to the field
    it means; the old name is renamed before validation, and giving both
    names is an error (they could disagree).
    """

    model_config = ConfigDict(extra="forbid", validate_default=True)
    _ALIASES: ClassVar[dict[str, str]] = {}

    @field_validator("*", mode="before")
    @classmethod
    def _strict_bool(cls, value: Any, info) -> Any:
        """A boolean key takes only true or false: "yes", "no", 1 or "false"
        are not coerced (pydantic would read "false" as False and "yes" as True)."""
        field = cls.model_fields.get(info.field_name)
        if field is not None and _unwrap(field.annotation)[0] is bool and not isinstance(value, bool):
            if value is None and _unwrap(field.annotation)[2]:
                return value
            raise _Problem(f"expected true or false, got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _rename_aliases(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not any(a in data for a in cls._ALIASES):
            return data
        data = dict(data)
        for old, new in cls._ALIASES.items():
            if old in data:
                if new in data:
                    raise _Problem(f"both '{old}' and '{new}' are given; '{old}' is the old name of "
                                   f"'{new}', keep only '{new}'", key=old)
                data[new] = data.pop(old)
        return data


# ---------------------------------------------------------------------------
# Sections, in the order of REFERENCE.md §2.

def _known_names(names: typing.Iterable[str]) -> dict[str, str]:
    return {n.lower(): n for n in names}


# torch.optim classes are usable by name in `optimizer.type`, as in DeepSpeed.
_TORCH_OPTIMIZERS = [
    name for name, obj in vars(torch.optim).items()
    if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer
]
OPTIMIZER_NAMES = _known_names(["Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion", "OneBitAdam",
                                "ZeroOneAdam", "OneBitLamb", *_TORCH_OPTIMIZERS])
# DeepSpeed's constants for optimizer.type values (`deepspeed.runtime.config.LAMB_OPTIMIZER`, ...):
# lower-case names, compared with the config's type by scripts such as BERT pre-training.
ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER = "adagrad", "adam", "adamw", "lamb"
ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER = "onebitadam", "zerooneadam", "onebitlamb"
LION_OPTIMIZER = "lion"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
                        ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER, LION_OPTIMIZER]
SCHEDULER_NAMES = _known_names(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"])


def _canonical_name(value: str, known: dict[str, str], what: str) -> str:
    """Return the canonical spelling of `value` (matched case-insensitively).

    Raises:
        _Problem: `value` is not a known name; the message gives the closest one.
    """
    if value.lower() in known:
        return known[value.lower()]
    close = difflib.get_close_matches(value.lower(), list(known), n=1, cutoff=0.5)
    hint = f"did you mean '{known[close[0]]}'? " if close else ""
    raise _Problem(f"unknown {what} '{value}'; {hint}known: {', '.join(sorted(known.values()))}")


class OptimizerConfig(_Section):
    """`optimizer`: which optimizer the engine builds when none is passed in."""

    type: str = Field(description="Optimizer name, case-insensitive: Adam, AdamW, SGD, Adagrad, Lamb, Lion, "
                                  "OneBitAdam, ZeroOneAdam, OneBitLamb, or any torch.optim class name. "
                                  "Stored in its canonical spelling.")
    params: dict[str, Any] = Field(default_factory=dict,
                                   description="Keyword arguments of the optimizer (lr, betas, eps, "
                                               "weight_decay, ...); checked when the optimizer is built.")

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        return _canonical_name(value, OPTIMIZER_NAMES, "optimizer type")

    @model_validator(mode="after")
    def _common_params(self) -> OptimizerConfig:
        """Check the hyperparameters most optimizers share here, with the
        other config problems, rather than when torch builds the optimizer."""
        problems = [(f"params.{key}", text) for key, text in _optimizer_param_problems(self.params)]
        if problems:
            first_key, first = problems[0]
            rest = "".join(f"; also optimizer.{key}: {text}" for key, text in problems[1:])
            raise _Problem(first + rest, key=first_key)
        return self


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _optimizer_param_problems(params: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, problem) for each shared optimizer hyperparameter with a bad value."""
    out = []
    for key in ("lr", "eps", "weight_decay", "momentum", "dampening"):
        if key in params and not (_real(params[key]) and 0 <= params[key] < float("inf")):
            out.append((key, f"expected a finite number >= 0, got {params[key]!r}"))
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2
                and all(_real(b) and 0 <= b < 1 for b in betas)):
            out.append(("betas", f"expected two numbers in [0, 1) such as [0.9, 0.999], got {betas!r}"))
    return out


class SchedulerConfig(_Section):
    """`scheduler`: which learning-rate schedule the engine builds."""

    type: str = Field(description="Schedule name, case-insensitive: WarmupLR, WarmupDecayLR, "
                                  "WarmupCosineLR, OneCycle or LRRangeTest.")
    params: dict[str, Any] = Field(default_factory=dict,
                                   description="Keyword arguments of the schedule (warmup_num_steps, "
                                               "total_num_steps, ...); checked when it is built.")

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        return _canonical_name(value, SCHEDULER_NAMES, "scheduler type")


class Fp16Config(_Section):
    """`fp16`: fp16 mixed precision with a (dynamic) loss scale."""

    enabled: bool = Field(False, description="Train with fp16 parameters and fp32 master weights.")
    auto_cast: bool = Field(False, description="Cast floating-point inputs of forward to fp16.")
    loss_scale: NonNegReal = Field(0.0, description="Static loss scale; 0 selects dynamic loss scaling.")
    initial_scale_power: Annotated[int, _NUMBER, at.Interval(ge=0, le=32)] = Field(
        16, description="Dynamic scaling starts at 2**initial_scale_power. At most 32: fp16's largest "
                        "value is 65504 (about 2**16), so a larger scale overflows on every step until "
                        "halved back down.")
    loss_scale_window: PosInt = Field(1000, description="Steps without overflow before the dynamic scale "
                                                        "is doubled.")
    hysteresis: PosInt = Field(2, description="Overflows tolerated before the dynamic scale is halved.")
    consecutive_hysteresis: bool = Field(False, description="Refill the hysteresis after every step "
                                                            "without overflow, not only after a window.")
    min_loss_scale: PosReal = Field(1.0, description="The dynamic scale never drops below this value.")
    fp16_master_weights_and_grads: bool = Field(False, description="Keep master weights and gradients "
                                                "in fp16 too (no fp32 copy).")


class Bf16Config(_Section):
    """`bf16` (old name `bfloat16`): bf16 mixed precision (no loss scale needed)."""

    enabled: bool = Field(False, description="Train with bf16 parameters and fp32 master weights.")


class DataTypesConfig(_Section):
    """`data_types`: dtypes of internal buffers."""

    grad_accum_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = Field(
        None, description="Dtype gradients are accumulated in across micro-batches; null = the "
                          "parameters' dtype (fp32 master gradients under mixed precision).")


class OffloadOptimizerConfig(_Section):
    """`zero_optimization.offload_optimizer`: where optimizer states live (ZeRO 1-3)."""

    device: Device = Field("none", description="none, cpu (host memory) or nvme (files under nvme_path).")
    nvme_path: Optional[Path] = Field(None, description="Directory for the state files; required with "
                                                        "device nvme.")
    pin_memory: bool = Field(False, description="Keep offloaded states in page-locked host memory "
                                                "(faster transfers, less pageable memory).")
    buffer_count: PosInt = Field(4, description="Number of buffers used to stream states from NVMe.")
    ratio: Annotated[float, _NUMBER, at.Ge(0.0), at.Le(1.0)] = Field(
        1.0, description="Fraction of the optimizer states offloaded to NVMe (the rest stays in memory).")
    fast_init: bool = Field(False, description="Initialise NVMe-offloaded states faster (DeepSpeed's "
                                               "knob; dsrun's swap files are preallocated anyway).")

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadOptimizerConfig:
        _check_nvme_path(self.device, self.nvme_path)
        if self.ratio != 1.0 and self.device != "nvme":
            raise _Problem("partial offload is built for device nvme only; set ratio to 1.0 or device "
                           "to nvme", key="ratio")
        return self


class OffloadParamConfig(_Section):
    """`zero_optimization.offload_param`: where partitioned parameters live (ZeRO 3 only)."""

    device: Device = Field("none", description="none, cpu (host memory) or nvme (files under nvme_path).")
    nvme_path: Optional[Path] = Field(None, description="Directory for the parameter files; required "
                                                        "with device nvme.")
    pin_memory: bool = Field(False, description="Keep offloaded parameters in page-locked host memory.")
    buffer_count: PosInt = Field(5, description="Number of buffers used to stream parameters from NVMe.")
    buffer_size: PosInt = Field(100_000_000, description="Size of each NVMe buffer, in elements.")
    max_in_cpu: Count = Field(1_000_000_000, description="Most parameter elements kept in host memory "
                                                         "when offloading to NVMe.")

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadParamConfig:
        _check_nvme_path(self.device, self.nvme_path)
        return self


def _fill(model: BaseModel, name: str, value: Any) -> None:
    """Set a field computed from other fields without marking it as given in the config."""
    given = name in model.model_fields_set
    setattr(model, name, value)
    if not given:
        model.model_fields_set.discard(name)


def _check_nvme_path(device: str, nvme_path: Path | None) -> None:
    if device == "nvme" and nvme_path is None:
        raise _Problem("required when device is 'nvme'; set it to a directory on a fast local drive",
                       key="nvme_path")


class ZeroConfig(_Section):
    """`zero_optimization`: ZeRO partitioning of optimizer states, gradients, parameters.

    The `stage3_*` keys are also accepted without the prefix, as DeepSpeed
    does. Old keys: `cpu_offload: true` means offload_optimizer.device cpu,
    `cpu_offload_param: true` means offload_param.device cpu,
    `cpu_offload_use_pin_memory` sets pin_memory of both.
    """

    _ALIASES: ClassVar[dict[str, str]] = {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }

    stage: Annotated[int, _NUMBER, at.Interval(ge=0, le=3)] = Field(
        0, description="0 = off (data parallel), 1 = partition optimizer states, 2 = also gradients, "
                       "3 = also parameters.")
    allgather_partitions: bool = Field(True, description="Gather updated partitions with all-gather "
                                                         "(false: a series of broadcasts).")
    allgather_bucket_size: PosInt = Field(500_000_000, description="Elements per all-gather bucket.")
    overlap_comm: Optional[bool] = Field(None, description="Overlap gradient reduction with backward; "
                                                           "default true for stage 3, false otherwise.")
    reduce_scatter: bool = Field(True, description="Reduce gradients with reduce-scatter (false: "
                                                   "all-reduce).")
    reduce_bucket_size: PosInt = Field(500_000_000, description="Elements per gradient-reduction bucket.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into one contiguous buffer as "
                                                         "they are produced (less fragmentation).")
    sub_group_size: PosInt = Field(1_000_000_000, description="Elements per optimizer sub-group stepped "
                                                              "at a time (bounds offload buffers).")
    stage3_prefetch_bucket_size: Count = Field(50_000_000, description="Elements of parameters "
                                                                       "prefetched ahead of use.")
    stage3_param_persistence_threshold: Count = Field(100_000, description="Parameters smaller than this "
                                                      "(elements) stay gathered after use.")
    stage3_model_persistence_threshold: Count = Field(2**63 - 1, description="Most elements kept "
                                                      "gathered in total because of the threshold above.")
    stage3_max_live_parameters: Count = Field(1_000_000_000, description="Most gathered parameter "
                                              "elements alive at once.")
    stage3_max_reuse_distance: Count = Field(1_000_000_000, description="A parameter reused within this "
                                             "many elements of other parameters is not freed in between.")
    stage3_unit_modules: Optional[list[str]] = Field(
        None, description="dsrun: the stage-3 gather units, as fnmatch patterns of module names "
                          "(\"layers.*\") or class names (\"Block\"); each matching module's parameters "
                          "are gathered with one all-gather. Default: each element of an nn.ModuleList "
                          "or nn.Sequential, plus the root.")
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="save_16bit_model gathers full 16-bit weights (old name: "
                           "stage3_gather_fp16_weights_on_model_save).")
    ignore_unused_parameters: bool = Field(True, description="Parameters that get no gradient are not "
                                                             "an error.")
    round_robin_gradients: bool = Field(False, description="Stage 1/2 with CPU offload: spread gradient "
                                                           "copies over ranks round-robin.")
    elastic_checkpoint: bool = Field(False, description="Stage 1/2 checkpoints loadable on another world "
                                     "size; dsrun checkpoints always are, so this has no effect.")
    load_from_fp32_weights: bool = Field(True, description="Restore master weights from the fp32 copy in "
                                         "the checkpoint, not from the 16-bit model weights.")
    memory_efficient_linear: bool = Field(True, description="Stage 3: use a linear layer that frees its "
                                          "gathered weight before backward.")
    zero_hpz_partition_size: PosInt = Field(1, description="ZeRO++ hpZ (stage 3): keep a secondary copy "
                                            "of each parameter partitioned over blocks of this many "
                                            "consecutive ranks (the ranks of a node, or a divisor), so the "
                                            "backward all-gather stays inside the node; 1 = off.")
    zero_quantized_weights: bool = Field(False, description="ZeRO++ qwZ (stage 3): forward/backward "
                                         "all-gathers send weights as block-wise int8 with fp32 scales.")
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ qgZ (stage 3): gradients reduce-"
                                           "scattered as block-wise int4 by an all-to-all within each node, "
                                           "then one across nodes.")
    zero_quantized_nontrainable_weights: bool = Field(False, description="ZeRO++ (stage 3): keep frozen "
                                                      "(requires_grad=False) parameters' partitions as "
                                                      "block-wise int8, quantized once, and all-gather them "
                                                      "as int8.")
    mics_shard_size: Int = Field(-1, description="MiCS: ranks a model state is sharded over; -1 = off.")
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig,
                                                      description="Offload of optimizer states.")
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig,
                                              description="Offload of parameters (stage 3 only).")

    @model_validator(mode="before")
    @classmethod
    def _old_offload_flags(cls, data: Any) -> Any:
        """Translate DeepSpeed's old boolean offload keys into the sections."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for old, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old not in data:
                continue
            if section in data:
                raise _Problem(f"'{old}' is the old form of '{section}'; give only '{section}'", key=old)
            flag = data.pop(old)
            if not isinstance(flag, bool):
                raise _Problem(f"expected true or false, got {flag!r}", key=old)
            if flag:
                data[section] = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in data:
            pin = data.pop("cpu_offload_use_pin_memory")
            for section in ("offload_optimizer", "offload_param"):
                if isinstance(data.get(section), Mapping):
                    data[section] = {**data[section], "pin_memory": pin}
        return data

    @model_validator(mode="after")
    def _stage_rules(self) -> ZeroConfig:
        if self.overlap_comm is None:
            _fill(self, "overlap_comm", self.stage == 3)
        if self.offload_param.device != "none" and self.stage != 3:
            raise _Problem(f"offloading parameters needs stage 3 (stage is {self.stage}); set "
                           f"zero_optimization.stage to 3 or remove offload_param", key="offload_param")
        if self.zero_quantized_weights and self.stage != 3:
            raise _Problem(f"quantized weight all-gathers (ZeRO++ qwZ) need stage 3 (stage is {self.stage}); "
                           "set zero_optimization.stage to 3 or remove zero_quantized_weights",
                           key="zero_quantized_weights")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            raise _Problem(f"hierarchical partitioning (ZeRO++ hpZ) needs stage 3 (stage is {self.stage}); "
                           "set zero_optimization.stage to 3 or zero_hpz_partition_size to 1",
                           key="zero_hpz_partition_size")
        if self.zero_quantized_gradients and self.stage != 3:
            raise _Problem(f"quantized gradient reduction (ZeRO++ qgZ) needs stage 3 (stage is {self.stage}); "
                           "set zero_optimization.stage to 3 or remove zero_quantized_gradients",
                           key="zero_quantized_gradients")
        if self.zero_quantized_nontrainable_weights and self.stage != 3:
            raise _Problem(f"int8 frozen weights (ZeRO++ zero_quantized_nontrainable_weights) need stage 3, "
                           f"where frozen parameters are partitioned (stage is {self.stage}; below it every "
                           "rank keeps them whole); set zero_optimization.stage to 3 or remove "
                           "zero_quantized_nontrainable_weights", key="zero_quantized_nontrainable_weights")
        return self


class AioConfig(_Section):
    """`aio`: asynchronous file I/O used by NVMe offload."""

    _ALIASES: ClassVar[dict[str, str]] = {"thread_count": "intra_op_parallelism"}

    block_size: PosInt = Field(1_048_576, description="Bytes per I/O request.")
    queue_depth: PosInt = Field(8, description="I/O requests in flight per thread.")
    intra_op_parallelism: PosInt = Field(1, description="Threads per read/write (old name: thread_count).")
    single_submit: bool = Field(False, description="Submit requests one at a time instead of in batches.")
    overlap_events: bool = Field(True, description="Submit new requests while waiting for completions.")


class ActivationCheckpointingConfig(_Section):
    """`activation_checkpointing`: options of dsrun.checkpointing (applied by initialize() unless the
    script called checkpointing.configure() first; see activation_checkpointing/checkpointing.py)."""

    partition_activations: bool = Field(False, description="Partition checkpointed activations across "
                                                           "model-parallel ranks.")
    cpu_checkpointing: bool = Field(False, description="Keep checkpointed activations in host memory.")
    contiguous_memory_optimization: bool = Field(False, description="Copy checkpoints into one buffer.")
    number_checkpoints: Optional[PosInt] = Field(None, description="Number of checkpoints, for the "
                                                                   "contiguous buffer.")
    synchronize_checkpoint_boundary: bool = Field(False, description="Synchronize the device at each "
                                                                     "checkpoint boundary.")
    profile: bool = Field(False, description="Time the checkpointed forward and recompute.")


class MonitorConfig(_Section):
    """`tensorboard` / `csv_monitor`: write training metrics."""

    enabled: bool = Field(False, description="On rank 0, write loss, lr, grad norm, loss scale, "
                          "throughput, step time, peak memory and collectives per optimizer step "
                          "(dsrun/runtime/monitor/events.py).")
    output_path: str = Field("", description="Directory for the output; empty = current directory.")
    job_name: str = Field("DeepSpeedJobName", description="Subdirectory name of this run.")


class WandbConfig(_Section):
    """`wandb`: log training metrics to Weights & Biases."""

    enabled: bool = Field(False, description="On rank 0, log the per-step events (as tensorboard) to a "
                          "W&B run; WANDB_MODE=offline keeps it on disk.")
    group: Optional[str] = Field(None, description="W&B group of the run.")
    team: Optional[str] = Field(None, description="W&B team (entity).")
    project: str = Field("deepspeed", description="W&B project.")


class FlopsProfilerConfig(_Section):
    """`flops_profiler`: count FLOPs, parameters and latency of one step."""

    enabled: bool = Field(False, description="Profile one training step.")
    recompute_fwd_factor: NonNegReal = Field(0.0, description="Extra forward passes due to activation "
                                                              "recomputation (0 = none, 1 = full).")
    profile_step: PosInt = Field(1, description="Profile the first forward after this many optimizer "
                                 "steps (DeepSpeed's counting), print at the end of that step.")
    module_depth: Int = Field(-1, description="Depth of the module tree to print; -1 = all.")
    top_modules: PosInt = Field(1, description="Number of top modules to list.")
    detailed: bool = Field(True, description="Print the per-module profile.")
    output_file: Optional[str] = Field(None, description="File to write the profile to; null = stdout.")


class CommsLoggerConfig(_Section):
    """`comms_logger`: count and time the collectives of each step."""

    enabled: bool = Field(False, description="Record every collective (op, bytes, time).")
    verbose: bool = Field(False, description="Print each collective as it happens.")
    prof_all: bool = Field(True, description="Record all ops (false: only those in prof_ops).")
    prof_ops: list[str] = Field(default_factory=list, description="Ops to record when prof_all is "
                                                                  "false, e.g. [\"all_reduce\"].")
    debug: bool = Field(False, description="Also record the caller of each collective.")


class CheckpointConfig(_Section):
    """`checkpoint`: engine.save_checkpoint / load_checkpoint (dsrun.runtime.checkpoint)."""

    keep_last: Optional[PosInt] = Field(None, description="dsrun: after a committed save, delete the "
                                        "oldest complete tags of the save directory so that this many "
                                        "remain (null = keep all). Incomplete tags are left alone.")
    async_save: bool = Field(False, description="dsrun: save_checkpoint returns at once; a background "
                             "thread writes and commits (the next optimizer step first copies what it has "
                             "not written yet). The next save, load or engine.wait_checkpoint() waits for "
                             "it and raises its error.")
    tag_validation: Literal["Warn", "Ignore", "Fail"] = Field(
        "Warn", description="What to do when ranks pass different tags to save_checkpoint or "
                            "load_checkpoint: Warn and Ignore use rank 0's tag on every rank (Warn "
                            "logs which ranks differed), Fail raises on every rank before any file "
                            "is touched.")
    strict_paths: bool = Field(False, description="dsrun: when ranks pass different directories or tags "
                               "to save_checkpoint / load_checkpoint, raise on every rank before any file "
                               "is touched (as DSRUN_STRICT_CONFIG=1 does) instead of using rank 0's "
                               "with a warning.")
    load_universal: bool = Field(False, description="Load a DeepSpeed universal checkpoint; every dsrun "
                                 "checkpoint loads on any world size and stage, so this has no effect.")
    use_node_local_storage: bool = Field(False, description="Each node writes to its own storage.")


class _BatchTriple(_Section):
    """The three batch keys, validated on their own (see [Note: order of the checks])."""

    model_config = ConfigDict(extra="ignore")

    train_batch_size: Optional[PosInt] = Field(
        None, description="Samples per optimizer step over all ranks: micro-batch x gradient "
                          "accumulation steps x data-parallel world size.")
    train_micro_batch_size_per_gpu: Optional[PosInt] = Field(
        None, description="Samples per forward/backward on one rank.")
    gradient_accumulation_steps: Optional[PosInt] = Field(
        None, description="Micro-batches accumulated before each optimizer step.")


def _never_for_inf(value: Any) -> Any:
    """steps_per_print: inf (what Accelerate writes) means never: a period no run reaches."""
    if isinstance(value, float) and value == float("inf"):
        return 2**63 - 1
    return value


# Top-level DeepSpeed sections that dsrun does not implement at all: a key
# from this list gets this explanation instead of "unknown key" when the
# section sets anything but `"enabled": false` (see _deepspeed_forms).
_DEEPSPEED_ONLY_KEYS = {
    "amp": "NVIDIA Apex AMP",
    "pipeline": "pipeline parallelism",
    "elasticity": "elastic training",
    "autotuning": "the autotuner",
    "compression_training": "compression training",
    "curriculum_learning": "curriculum learning",
    "data_efficiency": "data efficiency",
    "nebula": "Nebula checkpointing",
    "hybrid_engine": "the hybrid engine",
    "sparse_attention": "sparse attention",
    "eigenvalue": "eigenvalue computation",
    "progressive_layer_drop": "progressive layer drop",
    "comet": "Comet monitoring",
}


class DsConfig(_BatchTriple):
    """A validated ds_config. Build it with `load_config`, which also
    resolves the batch triple for the world size.

    Field names are DeepSpeed's JSON keys; defaults are DeepSpeed's (v0.19).
    """

    model_config = ConfigDict(extra="forbid")
    _ALIASES: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}

    optimizer: Optional[OptimizerConfig] = Field(None, description="Optimizer built by the engine; "
                                                 "null = the one passed to initialize().")
    scheduler: Optional[SchedulerConfig] = Field(None, description="LR schedule built by the engine; "
                                                 "null = the one passed to initialize(), or none.")
    fp16: Fp16Config = Field(default_factory=Fp16Config, description="fp16 mixed precision.")
    bf16: Bf16Config = Field(default_factory=Bf16Config, description="bf16 mixed precision (old name: "
                                                                     "bfloat16).")
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="Buffer dtypes.")
    gradient_clipping: NonNegReal = Field(1.0, description="Clip the global gradient norm to this value; "
                                          "0 = off. Default 1.0 as in DeepSpeed v0.19 (0.0 up to v0.16).")
    communication_data_type: Optional[Literal["fp32", "fp16", "bf16"]] = Field(
        None, description="Dtype gradients are reduced in across ranks; null = the compute dtype "
                          "(bf16/fp16 runs send 16-bit gradients, as DeepSpeed does).")
    prescale_gradients: bool = Field(False, description="Divide gradients by the world size before "
                                                        "reducing them instead of after.")
    gradient_predivide_factor: PosReal = Field(1.0, description="Divide gradients by this before "
                                               "reducing and by world_size/factor after.")
    sparse_gradients: bool = Field(False, description="Reduce gradients of sparse embeddings as sparse "
                                                      "tensors.")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO partitioning.")
    zero_allow_untested_optimizer: bool = Field(False, description="Allow ZeRO with an optimizer that "
                                                "is not one of the built-in ones.")
    zero_force_ds_cpu_optimizer: bool = Field(True, description="With optimizer offload, require the "
                                              "native CPU optimizer.")
    aio: AioConfig = Field(default_factory=AioConfig, description="Asynchronous I/O for NVMe offload.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="Checkpoint saving and loading.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="Activation checkpointing options.")
    steps_per_print: Annotated[int, BeforeValidator(_never_for_inf), _NUMBER, at.Ge(1)] = Field(
        10, description="Log progress every this many optimizer steps; inf (Accelerate's setting) = never "
                        "(stored as 2**63 - 1).")
    wall_clock_breakdown: bool = Field(False, description="Time forward, backward (with its gradient "
                                       "reduction) and step, synchronizing CUDA; rank 0 logs the mean per "
                                       "step and the collectives' share every steps_per_print steps.")
    memory_breakdown: bool = Field(False, description="Measure memory per phase of each step (RSS, "
                                   "CUDA allocator, tensors held) and log it on rank 0 every "
                                   "steps_per_print steps (see Engine.memory_profile).")
    max_consecutive_nonfinite_steps: Count = Field(
        10, description="dsrun: stop with an error (NonFiniteStepsError, on every rank) after this many "
                        "optimizer steps in a row were skipped for an inf/nan gradient that no dynamic "
                        "fp16 loss scale accounts for (fp32, bf16, static fp16 scale); 0 = never stop.")
    dump_state: bool = Field(False, description="Print the engine's state after initialization.")
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig, description="TensorBoard output.")
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="CSV output.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging.")
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig,
                                                description="FLOPs profiler.")
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig,
                                            description="Collective-communication logger.")

    # The world size load_config resolved the batch triple for.
    _world_size: Optional[int] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_precision(self) -> DsConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise _Problem("fp16 and bf16 are both enabled; enable at most one of them "
                           "(set fp16.enabled or bf16.enabled to false)", key="bf16")
        return self

    def get(self, key: str, default: Any = None) -> Any:
        """The value of top-level `key` as plain JSON data (sections as dicts,
        defaults filled in), or `default` when it is not a config key or is
        null: DeepSpeed's engine.config is a dict, and scripts and Hugging
        Face read it as `engine.config.get("zero_optimization", {}).get("stage")`."""
        if key not in type(self).model_fields:
            return default
        value = self.model_dump(mode="json", include={key}).get(key)
        return default if value is None else value

    def __getitem__(self, key: str) -> Any:
        """`config["zero_optimization"]["stage"]`, as on DeepSpeed's config dict.
        Raises KeyError for a key that is not a config key."""
        if key not in type(self).model_fields:
            raise KeyError(key)
        return self.get(key)

    def __contains__(self, key: str) -> bool:
        return key in type(self).model_fields and getattr(self, key) is not None

    def summary(self, all_keys: bool = False) -> str:
        """The effective config as readable text, for logs.

        Args:
            all_keys: list every key; by default only keys given in the
                config are listed, plus the batch triple, and the number of
                keys left at their defaults.

        Returns:
            Several lines: a header, the batch arithmetic, then one
            `dotted.key  value` per line; `*` marks keys set in the config.
        """
        lines = ["dsrun config" + ("" if self._world_size is None else f" (world size {self._world_size})")]
        if self._world_size is not None:
            lines.append(f"  batch: {self.train_batch_size} = {self.train_micro_batch_size_per_gpu} (micro) x "
                         f"{self.gradient_accumulation_steps} (gas) x {self._world_size} (world size)")
        leaves = list(_leaves(self, ""))
        shown = [leaf for leaf in leaves if all_keys or leaf[2]]
        width = max((len(path) for path, _, _ in shown), default=0)
        for path, value, given in shown:
            lines.append(f"  {'*' if given else ' '} {path:<{width}}  {_show(value)}")
        if not all_keys:
            lines.append(f"  ({len(leaves) - len(shown)} other keys at their defaults)")
        else:
            lines.append("  (* = set in the config)")
        return "\n".join(lines)


def _leaves(model: BaseModel, prefix: str) -> typing.Iterator[tuple[str, Any, bool]]:
    """Yield (dotted path, value, given in the config) for every leaf field."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            yield from _leaves(value, path + ".")
        else:
            yield path, value, name in model.model_fields_set


def _set_values(model: BaseModel) -> dict[str, Any]:
    """The keys set in a config, given or assigned later, as a nested dict.

    Unlike model_dump(exclude_unset=True) this keeps a value assigned inside
    a section that was not given. Values inferred by load_config are not
    marked as set (see _fill), so loading the result infers them again.
    """
    out: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            inner = _set_values(value)
            if inner or name in model.model_fields_set:
                out[name] = inner
        elif name in model.model_fields_set:
            out[name] = value
    return out


def _show(value: Any) -> str:
    if isinstance(value, Path):
        return str(value)
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


# ---------------------------------------------------------------------------
# Features not built yet. Each entry rejects one setting; delete the entry
# when the feature lands.

@dataclass(frozen=True)
class Unsupported:
    """One setting this release rejects.

    Attributes:
        path: dotted key path of the setting in the config.
        applies: predicate on the validated value; true means rejected.
        feature: what is not implemented, as a noun phrase.
        fix: how to get a supported config ("set it to 0").
    """

    path: str
    applies: Callable[[Any], bool]
    feature: str
    fix: str = "set it to false"


def _on(value: Any) -> bool:
    return bool(value)


NOT_YET_SUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("fp16.auto_cast", _on, "fp16 auto-casting of inputs"),
    Unsupported("fp16.fp16_master_weights_and_grads", _on, "fp16 master weights"),
    Unsupported("zero_optimization.mics_shard_size", lambda v: v > 0, "MiCS sharding", "set it to -1"),
    Unsupported("sparse_gradients", _on, "sparse gradients"),
    Unsupported("checkpoint.use_node_local_storage", _on, "node-local checkpoint storage (dsrun needs "
                "one directory every rank can read)"),
    Unsupported("prescale_gradients", _on, "gradient prescaling"),
    Unsupported("gradient_predivide_factor", lambda v: v != 1.0, "a gradient predivide factor",
                "set it to 1.0"),
    Unsupported("dump_state", _on, "dumping the engine state"),
)


def _unsupported(cfg: DsConfig) -> list[str]:
    problems = []
    for entry in NOT_YET_SUPPORTED:
        value: Any = cfg
        for part in entry.path.split("."):
            value = getattr(value, part, None)  # None when a parent section is absent
        if value is not None and entry.applies(value):
            problems.append(f"{entry.path}={_show(value)}: {_RELEASE} does not support {entry.feature} "
                            f"yet; remove it or {entry.fix}")
    return problems


# Settings that are accepted, so that DeepSpeed configs load, but that this
# release does not act on. Each maps to the value dsrun behaves as (it always
# overlaps, reduce-scatters, all-gathers, uses contiguous buffers, tolerates
# unused parameters, frees gathered stage-3 weights before backward and takes
# any optimizer; the rest are knobs of parts not built yet). load_config
# warns, naming each one the config sets to anything else, instead of
# ignoring it silently; delete an entry when its setting takes effect.
# tests/config/test_keys_take_effect.py fails on a key that is read by
# nothing and listed neither here nor in NOT_YET_SUPPORTED.
NO_EFFECT_YET: dict[str, Any] = {
    "zero_optimization.overlap_comm": True,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,  # save_16bit_model always gathers
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.load_from_fp32_weights": True,  # checkpoints always restore the fp32 masters
    "zero_optimization.memory_efficient_linear": True,
    "zero_allow_untested_optimizer": True,
    "activation_checkpointing.contiguous_memory_optimization": False,  # no copy into one buffer
    "activation_checkpointing.number_checkpoints": None,
    "checkpoint.load_universal": True,
    "comms_logger.debug": False,  # callers of collectives are not recorded
    "zero_optimization.offload_optimizer.fast_init": False,  # swap files are preallocated in one call
    "zero_optimization.offload_param.buffer_size": 100_000_000,  # NVMe reads whole unit partitions
    "zero_optimization.offload_param.max_in_cpu": 1_000_000_000,  # no host cache of NVMe partitions
}


class ConfigWarning(UserWarning):
    """A config setting that is valid but has no effect in this release."""


def _user_value(cfg: DsConfig, path: str) -> tuple[bool, Any]:
    """(True, value) when the config file/dict itself set the dotted `path`."""
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, BaseModel) or part not in node.model_fields_set:
            return False, None
        node = getattr(node, part)
    return True, node


def _warn_no_effect(cfg: DsConfig, source: str) -> None:
    keys = []
    for path, acts_as in NO_EFFECT_YET.items():
        is_set, value = _user_value(cfg, path)
        if is_set and value != acts_as:
            keys.append(f"{path}={_show(value)}")
    if keys:
        warnings.warn(f"{source}: {_RELEASE} accepts but does not act on {', '.join(keys)}; "
                      "the run goes on as if they were left out", ConfigWarning, stacklevel=3)


# ---------------------------------------------------------------------------
# Batch triple

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_batch_triple(train_batch_size: int | None, micro_batch: int | None, grad_accum: int | None,
                         world_size: int) -> tuple[int, int, int]:
    """Fill in the batch triple from what was given.

    train_batch_size = micro_batch x grad_accum x world_size, where
    world_size is the data-parallel world size. Two given infer the third;
    only the micro-batch given means grad_accum 1; only train_batch_size
    given means grad_accum 1 and micro = train_batch_size / world_size.

    Returns:
        (train_batch_size, micro_batch, grad_accum), all positive ints.

    Raises:
        ConfigError: neither batch size is given, a value cannot be
            inferred as a whole number, or all three disagree; the message
            shows the arithmetic and the values that would fix it.
    """
    tbs, micro, gas, ws = train_batch_size, micro_batch, grad_accum, world_size

    def fail(text: str) -> typing.NoReturn:
        raise ConfigError(text)

    if tbs is None and micro is None:
        fail("train_batch_size: neither train_batch_size nor train_micro_batch_size_per_gpu is set; "
             "set at least one (gradient_accumulation_steps defaults to 1)")
    if tbs is None:
        gas = 1 if gas is None else gas
        return micro * gas * ws, micro, gas
    if micro is None:
        gas = 1 if gas is None else gas
        if tbs % (gas * ws):
            fail(f"train_batch_size={tbs} is not divisible by {gas} (gradient_accumulation_steps) x {ws} "
                 f"(world size) = {gas * ws}, so train_micro_batch_size_per_gpu cannot be inferred; "
                 f"set train_batch_size to a multiple of {gas * ws} or set train_micro_batch_size_per_gpu")
        return tbs, tbs // (gas * ws), gas
    if gas is None:
        if tbs % (micro * ws):
            fail(f"train_batch_size={tbs} is not divisible by {micro} (train_micro_batch_size_per_gpu) x "
                 f"{ws} (world size) = {micro * ws}, so gradient_accumulation_steps cannot be inferred; "
                 f"set train_batch_size to a multiple of {micro * ws}")
        return tbs, micro, tbs // (micro * ws)
    if tbs != micro * gas * ws:
        fixes = [f"train_batch_size to {micro * gas * ws}"]
        if tbs % (micro * ws) == 0:
            fixes.append(f"gradient_accumulation_steps to {tbs // (micro * ws)}")
        if tbs % (gas * ws) == 0:
            fixes.append(f"train_micro_batch_size_per_gpu to {tbs // (gas * ws)}")
        fix = fixes[0] if len(fixes) == 1 else f"{', '.join(fixes[:-1])} or {fixes[-1]}"
        fail(f"train_batch_size={tbs} but {micro} (train_micro_batch_size_per_gpu) x {gas} "
             f"(gradient_accumulation_steps) x {ws} (world size) = {micro * gas * ws}; set {fix}")
    return tbs, micro, gas


# ---------------------------------------------------------------------------
# Reading files


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads 5e8 / 1e-3 as numbers.

    PyYAML follows YAML 1.1, where a float needs a dot: `lr: 1e-3` would be
    the string "1e-3". YAML 1.2 and JSON read it as a number, and so do we.
    """


def _construct_mapping(loader: _YamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _compose_node(loader: _YamlLoader, parent, index):
    """Refuse aliases (`*name`) before they are expanded: nested aliases grow
    a few lines into gigabytes (a "billion laughs" file took 45 s and 3 GB)."""
    if loader.check_event(yaml.events.AliasEvent):
        event = loader.peek_event()
        raise yaml.composer.ComposerError(
            None, None, f"YAML alias *{event.anchor} is not allowed in a dsrun config; write the value "
            "out where it is used", event.start_mark)
    return yaml.composer.Composer.compose_node(loader, parent, index)


_YamlLoader.compose_node = _compose_node
_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                  list("-+0123456789"))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _read_file(path: Path) -> Any:
    """Parse a JSON or YAML (.yaml/.yml) file; raise ConfigError naming the file and position."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {what} (looked for {path.resolve()})", source=str(path))
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"not valid UTF-8: byte 0x{data[exc.start]:02x} at line {line} (byte offset "
                          f"{exc.start}); save the file as UTF-8", source=str(path)) from None
    if not text.strip():
        raise ConfigError("the config file is empty; write a JSON object or YAML mapping such as "
                          '{"train_batch_size": 8}', source=str(path))
    try:
        return _parse(path, text)
    except RecursionError:
        raise ConfigError("nested more than a few hundred levels deep; a ds_config has at most 3 levels of "
                          "sections", source=str(path)) from None


def _parse(path: Path, text: str) -> Any:
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            value = yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"not valid YAML{where}: {problem}", source=str(path)) from None
        if value is None:
            raise ConfigError("the config file has no keys (only comments or an empty document); write a "
                              "YAML mapping such as 'train_batch_size: 8'", source=str(path))
        return value
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                          source=str(path)) from None
    except ValueError as exc:
        raise ConfigError(f"not valid JSON: {exc}", source=str(path)) from None


# ---------------------------------------------------------------------------
# Translating pydantic's errors


def _unwrap(tp: Any) -> tuple[Any, list, bool]:
    """Strip Optional and Annotated: (base type, constraint metadata, nullable)."""
    meta: list = []
    nullable = False
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp, *extra = typing.get_args(tp)
            meta.extend(extra)
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            nullable = nullable or len(args) < len(typing.get_args(tp))
            if len(args) != 1:
                return tp, meta, nullable
            tp = args[0]
        else:
            return tp, meta, nullable


def _bounds(meta: list) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for item in meta:
        for name in ("ge", "gt", "le", "lt"):
            if getattr(item, name, None) is not None:
                found[name] = getattr(item, name)
    return found


def _describe(field: FieldInfo, item: bool = False) -> str:
    """What a field accepts, in words: 'an integer 0-3', "one of 'none', 'cpu'", ...

    With `item`, what one element of the field (a list) accepts.
    """
    tp, meta, nullable = _unwrap(field.annotation)
    if item and typing.get_origin(tp) is list:
        return "a string"
    b = _bounds([*field.metadata, *meta])
    if tp is bool:
        text = "true or false"
    elif tp in (int, float):
        noun = "an integer" if tp is int else "a number"
        b = {k: f"{v:g}" for k, v in b.items()}
        if "ge" in b and "le" in b:
            text = f"{noun} {b['ge']}-{b['le']}"
        elif tp is int and b.get("ge") == "1":
            text = "a positive integer"
        else:
            limits = [f"{sym} {b[k]}" for k, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                      if k in b]
            text = " ".join([noun, *limits])
    elif typing.get_origin(tp) is Literal:
        text = "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    elif typing.get_origin(tp) is list:
        text = "a list of strings"
    elif typing.get_origin(tp) is dict:
        text = "an object (key: value mapping)"
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        keys = list(tp.model_fields)
        text = "an object with keys such as " + ", ".join(keys[:4])
    elif tp is Path:
        text = "a path (string)"
    else:
        text = "a string"
    return text + " or null" if nullable else text


def _model_of(field: FieldInfo | None) -> type[BaseModel] | None:
    if field is None:
        return None
    tp = _unwrap(field.annotation)[0]
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _translate(error: dict) -> str:
    """One pydantic error -> one line starting with the dotted key path."""
    model: type[BaseModel] | None = DsConfig
    field: FieldInfo | None = None
    parts: list[str] = []
    loc = list(error["loc"])
    if error["type"] == "extra_forbidden":
        loc, key = loc[:-1], str(loc[-1])
    for part in loc:
        if model is not None and isinstance(part, str) and part in model.model_fields:
            field = model.model_fields[part]
            parts.append(part)
            model = _model_of(field)
        elif isinstance(part, int):
            parts.append(f"[{part}]")
    path = ".".join(parts).replace(".[", "[")

    if error["type"] == "extra_forbidden":
        return _unknown_key(path, key, model)
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, _Problem):
        full = ".".join(p for p in (path, cause.key) if p)
        return f"{full}: {cause.text}"
    if error["type"] == "missing":
        return f"{path}: missing; expected {_describe(field)}" if field else f"{path}: missing"
    if field is None:  # a failure of the top-level object itself
        return f"{error['msg']}"
    in_list = bool(loc) and isinstance(loc[-1], int)
    return f"{path}: expected {_describe(field, item=in_list)}, got {error['input']!r}"


def _unknown_key(section: str, key: str, model: type[BaseModel] | None) -> str:
    where = f"{section}.{key}" if section else key
    if not section and key in _DEEPSPEED_ONLY_KEYS:
        return f"{key}: {_DEEPSPEED_ONLY_KEYS[key]} is a DeepSpeed feature that dsrun does not implement; " \
               f"remove the '{key}' section"
    valid = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    scope = f"in {section}" if section else "at the top level"
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
    return f"{where}: unknown key '{key}' {scope}; {hint}"


# ---------------------------------------------------------------------------
# "auto"


def _pop_auto(node: Any, path: str) -> list[str]:
    """Remove every "auto" value from `node` (in place); return their key paths.

    [Note: "auto" values]
    Hugging Face's Trainer writes "auto" into ds_configs and replaces it
    with real numbers before DeepSpeed sees them. A config with "auto"
    given straight to DeepSpeed is silently wrong (nested values dropped,
    DeepSpeed #1270); here each one is an error. They are removed after
    being reported so that they do not also show up as type errors.
    """
    found = []
    if isinstance(node, dict):
        for key in list(node):
            sub = f"{path}.{key}" if path else str(key)
            if isinstance(node[key], str) and node[key].strip().lower() == "auto":
                del node[key]
                found.append(sub)
            else:
                found.extend(_pop_auto(node[key], sub))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found.extend(_pop_auto(item, f"{path}[{i}]"))
    return found


def _auto_problem(path: str) -> str:
    return (f"{path}: \"auto\" is a placeholder that the Hugging Face Trainer integration fills in; "
            f"when calling dsrun directly, replace it with a value")


# ---------------------------------------------------------------------------
# DeepSpeed's forms and foreign keys

STRICT_ENV = "DSRUN_STRICT_CONFIG"

# Keys a section accepts besides its fields and _ALIASES (read by its "before" validators).
_LEGACY_KEYS: dict[str, set[str]] = {"ZeroConfig": {"cpu_offload", "cpu_offload_param",
                                                    "cpu_offload_use_pin_memory"}}


def _disabled(section: Any) -> bool:
    """True for `{}`, `false` or a section whose `"enabled"` is false and whose
    subsections enable nothing (`{"enabled": false, "x": {"enabled": false}}`)."""
    if section is False or section == {}:
        return True
    if not isinstance(section, dict) or section.get("enabled") is not False:
        return False
    return all(_disabled(v) or not isinstance(v, dict) for k, v in section.items() if k != "enabled")


def _deepspeed_forms(data: dict) -> None:
    """Rewrite DeepSpeed's accepted forms in place (see [Note: DeepSpeed's forms and foreign keys]).

    [Note: DeepSpeed's forms and foreign keys]
    Real configs carry what DeepSpeed accepts without acting on it, and
    Hugging Face injects some of it: sections of features dsrun lacks that
    say `"enabled": false` (`hybrid_engine`, `amp`, `elasticity`, ...) are
    dropped, because they do nothing in DeepSpeed either; any other value
    of such a section is still rejected, naming the feature. The legacy `"zero_optimization": true` means stage 1 (false:
    stage 0). Keys DeepSpeed does not know at all, which it ignores, are
    treated by _drop_foreign_keys: a likely typo of a known key is an error
    with its "did you mean"; any other unknown key warns, naming it, and is
    dropped; DSRUN_STRICT_CONFIG=1 (or load_config(strict=True)) makes
    every unknown key an error.
    """
    for key in _DEEPSPEED_ONLY_KEYS:
        if key in data and _disabled(data[key]):
            del data[key]
    if isinstance(data.get("zero_optimization"), bool):
        data["zero_optimization"] = {"stage": 1 if data["zero_optimization"] else 0}


def _drop_foreign_keys(node: dict, model: type[BaseModel], path: str, strict: bool, source: str) -> None:
    """Drop (with one ConfigWarning) the unknown keys of `node` and its
    sections that are not a likely typo; typos and, when `strict`, every
    unknown key stay for validation to report."""
    dropped = _foreign_keys(node, model, path, strict)
    if dropped:
        warnings.warn(f"{source}: unknown keys ignored, as DeepSpeed ignores them: {', '.join(dropped)} "
                      f"(set {STRICT_ENV}=1 to make unknown keys errors)", ConfigWarning, stacklevel=3)


def _foreign_keys(node: dict, model: type[BaseModel], path: str, strict: bool) -> list[str]:
    aliases = getattr(model, "_ALIASES", {})
    known = [*model.model_fields, *aliases, *_LEGACY_KEYS.get(model.__name__, ())]
    if not path:
        known += list(_DEEPSPEED_ONLY_KEYS)
    dropped = []
    for key in list(node):
        sub = f"{path}.{key}" if path else str(key)
        name = aliases.get(key, key)
        if name in model.model_fields:
            inner = _model_of(model.model_fields[name])
            if inner is not None and isinstance(node[key], dict):
                dropped += _foreign_keys(node[key], inner, sub, strict)
        elif key not in known and not strict and not difflib.get_close_matches(str(key), known, n=1, cutoff=0.8):
            del node[key]
            dropped.append(sub)
    return dropped


def _unsupported_raw(data: dict) -> list[str]:
    """NOT_YET_SUPPORTED checked on raw values, for a config that failed
    validation (see [Note: order of the checks]); values that are not of
    the field's type are skipped (validation reported them)."""
    problems = []
    for entry in NOT_YET_SUPPORTED:
        value: Any = data
        for part in entry.path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        try:
            rejected = value is not None and not isinstance(value, (dict, list)) and entry.applies(value)
        except (TypeError, ValueError):
            continue
        if rejected:
            problems.append(f"{entry.path}={_show(value)}: {_RELEASE} does not support {entry.feature} "
                            f"yet; remove it or {entry.fix}")
    return problems


# ---------------------------------------------------------------------------
# Entry point


def offload_param_of(source: Mapping | str | os.PathLike | DsConfig) -> OffloadParamConfig:
    """`zero_optimization.offload_param` of a ds_config, validated on its own.

    zero.Init reads it while the model is built, when a Hugging Face config
    may still hold "auto" placeholders elsewhere that `load_config` rejects.
    DeepSpeed's old `cpu_offload_param: true` (with
    `cpu_offload_use_pin_memory`) reads as device cpu. Raises ConfigError
    when the file cannot be read or the section is invalid.
    """
    if isinstance(source, DsConfig):
        return source.zero_optimization.offload_param
    name = "dict" if isinstance(source, Mapping) else str(source)
    raw = source if isinstance(source, Mapping) else _read_file(Path(source))
    zero = raw.get("zero_optimization") if isinstance(raw, Mapping) else None
    if not isinstance(zero, Mapping):
        return OffloadParamConfig()
    section = zero.get("offload_param")
    if section is None and zero.get("cpu_offload_param") is True:
        section = {"device": "cpu", "pin_memory": bool(zero.get("cpu_offload_use_pin_memory", False))}
    try:
        return OffloadParamConfig.model_validate(section or {})
    except ValidationError as exc:
        raise ConfigError(*(f"zero_optimization.offload_param.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                            for e in exc.errors()), source=name) from None


def load_config(source: Mapping | str | os.PathLike | DsConfig, world_size: int | None = None,
                strict: bool | None = None) -> DsConfig:
    """Read, validate and resolve a ds_config.

    Args:
        source: a dict (as for DeepSpeed's `config=`), a path to a .json,
            .yaml or .yml file (other suffixes are read as JSON), or a
            DsConfig (validated again from the keys set in it, so the
            batch triple is inferred again for `world_size`).
        world_size: data-parallel world size for the batch triple; None
            reads the WORLD_SIZE environment variable, or 1 when it is unset.
        strict: every unknown key is an error; None reads DSRUN_STRICT_CONFIG
            ("1" = strict). Otherwise only a likely typo of a known key is an
            error and other unknown keys warn (ConfigWarning), naming them.

    Returns:
        A DsConfig whose train_batch_size, train_micro_batch_size_per_gpu and
        gradient_accumulation_steps are ints.

    Raises:
        ConfigError: the file is missing or does not parse, or the config
            has problems; every problem found is listed, one per line (see
            [Note: order of the checks]).
        ValueError: world_size is not a positive integer.
    """
    if world_size is None:
        env = os.environ.get("WORLD_SIZE", "1")
        if not env.strip().isdigit():
            raise ValueError(f"WORLD_SIZE={env!r} is not a positive integer; pass world_size= explicitly")
        world_size = int(env)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")

    if isinstance(source, DsConfig):
        name = "DsConfig"
        raw = _set_values(source)
    elif isinstance(source, Mapping):
        name, raw = "dict", source
    elif isinstance(source, (str, os.PathLike)):
        name = str(source)
        raw = _read_file(Path(source))
    else:
        raise ConfigError(f"a config must be a dict, a file path or a DsConfig, got {type(source).__name__}")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the config must be a JSON object / YAML mapping at the top level, got "
                          f"{type(raw).__name__}", source=name)

    try:
        data = json.loads(json.dumps(raw, default=str))  # a private deep copy, as plain JSON data
    except RecursionError:
        raise ConfigError("nested more than a few hundred levels deep; a ds_config has at most 3 levels "
                          "of sections", source=name) from None
    autos = _pop_auto(data, "")
    problems = [_auto_problem(p) for p in autos]
    if strict is None:
        strict = os.environ.get(STRICT_ENV, "") == "1"
    _deepspeed_forms(data)
    _drop_foreign_keys(data, DsConfig, "", strict, name)
    cfg = None
    try:
        cfg = DsConfig.model_validate(data)
    except ValidationError as exc:
        problems.extend(_translate(e) for e in exc.errors())
    triple = _batch_problems(data, world_size, skip=any(p in BATCH_KEYS for p in autos))
    if isinstance(triple, list):
        problems.extend(triple)
    if problems or cfg is None or not isinstance(triple, tuple):
        raise ConfigError(*problems, *_unsupported_raw(data), source=name)

    problems = _unsupported(cfg) + _world_problems(cfg, world_size)
    if problems:
        raise ConfigError(*problems, source=name)
    _warn_no_effect(cfg, name)
    for key, value in zip(BATCH_KEYS, triple):
        _fill(cfg, key, value)
    cfg._world_size = world_size
    return cfg


def _world_problems(cfg: DsConfig, world_size: int) -> list[str]:
    """Settings that must fit the world size (the node layout is checked
    when the strategy is built: zero/stage3.py `_hpz_group`)."""
    hpz = cfg.zero_optimization.zero_hpz_partition_size
    if hpz > 1 and world_size % hpz:
        return [f"zero_optimization.zero_hpz_partition_size={hpz} does not divide the world size "
                f"{world_size}; set it to the number of ranks per node (or a divisor of it), or 1"]
    return []


def _batch_problems(data: dict, world_size: int, skip: bool) -> tuple[int, int, int] | list[str]:
    """Resolve the triple from the raw keys alone (see [Note: order of the checks]).

    Returns the resolved triple, or a list of problems (empty when the keys
    themselves are invalid or "auto": those are reported elsewhere).
    """
    if skip:
        return []
    try:
        batch = _BatchTriple.model_validate({k: data[k] for k in BATCH_KEYS if k in data})
    except ValidationError:
        return []
    try:
        return resolve_batch_triple(batch.train_batch_size, batch.train_micro_batch_size_per_gpu,
                                    batch.gradient_accumulation_steps, world_size)
    except ConfigError as exc:
        return exc.problems

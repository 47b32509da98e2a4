"""The sections of a ds_config (optimizer, scheduler, fp16/bf16, zero_optimization, aio,
monitors, ...): one pydantic model each, with DeepSpeed's key names and defaults and a
description per field."""
from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

import warnings

import annotated_types as at
import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from dsrun.runtime.config.errors import ConfigWarning, _Problem

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
    mics_shard_size: Int = Field(-1, description="MiCS (stages 1-3): shard model states within blocks of "
                                 "this many consecutive data-parallel ranks and replicate them across the "
                                 "blocks; must divide the data-parallel size; -1 (or 0) = off.")
    mics_hierarchical_params_gather: bool = Field(False, description="MiCS: gather parameters in two steps "
                                                  "(across nodes, then within) when a shard group spans "
                                                  "nodes.")
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


class PipelineConfig(_Section):
    """`pipeline`: pipeline parallelism of a PipelineModule (dsrun.pipe). The module is built
    before the config is read, so `stages`, `partition` and `seed_layers` are checked against it
    (a mismatch is an error, where DeepSpeed ignores them); the schedule keys are dsrun's."""

    stages: Union[Literal["auto"], PosInt] = Field(
        "auto", description="Pipeline stages; auto = the PipelineModule's num_stages (an integer must "
                            "equal it).")
    partition: str = Field("best", description="Layer partitioning; best = the PipelineModule's "
                                               "partition_method (any other value must equal it).")
    seed_layers: bool = Field(False, description="Seed each layer before building it; true requires "
                                                 "PipelineModule(seed_layers=True).")
    activation_checkpoint_interval: Count = Field(
        0, description="Checkpoint activations every this many layers (0: the PipelineModule's "
                       "own interval); when set, it replaces the module's, as in DeepSpeed.")
    pipe_partitioned: bool = Field(True, description="Split activations sent between stages over "
                                                     "tensor-parallel ranks.")
    grad_partitioned: bool = Field(True, description="Split gradients sent between stages over "
                                                     "tensor-parallel ranks.")
    use_reentrant: bool = Field(True, description="Use reentrant activation checkpointing.")
    schedule: Literal["1f1b", "interleaved", "zb-h1"] = Field(
        "1f1b", description="Pipeline schedule: 1f1b (PipeDream-Flush, DeepSpeed's), interleaved "
                            "(several chunks per rank; needs virtual_stages >= 2) or zb-h1 (zero bubble, "
                            "backward split into input and weight passes).")
    virtual_stages: PosInt = Field(1, description="Model chunks per rank for the interleaved schedule; "
                                                  "must equal PipelineModule(virtual_stages=...).")


class TensorParallelConfig(_Section):
    """`tensor_parallel`: DeepSpeed's AutoTP training. `initialize()` shards the model's attention
    and MLP linear layers over `autotp_size` tensor-parallel ranks (as `dsrun.tp_model_init`; see
    dsrun/runtime/parallel/tensor/autotp.py) and the data-parallel axis gets the other ranks."""

    autotp_size: PosInt = Field(1, description="Tensor-parallel degree (ranks that each hold a slice of "
                                               "every attention and MLP weight); 1 = off. Must divide "
                                               "the world size (times the pipeline stages).")
    vocab_parallel: bool = Field(False, description="Also split the input embedding and the output layer "
                                                    "by vocabulary over the tensor-parallel ranks (tied "
                                                    "weights stay tied; the logits are gathered for the "
                                                    "model's own loss); see "
                                                    "dsrun/runtime/parallel/tensor/vocab.py.")


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


class AutotuningConfig(_Section):
    """`autotuning`: what `dsrun --autotuning tune|run` searches and how it measures (docs/autotuning.md).

    The launcher side (dsrun/autotuning) reads every key but the profile
    steps; the engine reads `enabled` and the profile steps while a trial runs.
    """

    enabled: bool = Field(False, description="Measure the profile steps and stop when the launcher runs "
                                             "this config as an autotuning trial.")
    fast: bool = Field(True, description="Tune ZeRO stage, micro-batch size and optimizer offload only; "
                                         "false also tunes the reduce/all-gather bucket sizes.")
    metric: Literal["throughput", "latency", "flops"] = Field(
        "throughput", description="What the best trial maximizes: samples/s, or the lowest time per step, "
                                  "or model FLOP/s per rank (6 x parameters x tokens/s / ranks).")
    start_profile_step: PosInt = Field(3, description="Optimizer steps run before timing starts (warm-up).")
    end_profile_step: PosInt = Field(5, description="A trial stops after this many optimizer steps; the "
                                                    "steps after start_profile_step are timed.")
    num_tuning_micro_batch_sizes: PosInt = Field(3, description="Micro-batch sizes tried per ZeRO stage, "
                                                 "spread up to the largest one that fits in memory.")
    max_train_batch_size: Optional[PosInt] = Field(None, description="Largest global batch a trial may use; "
                                                   "null = no limit.")
    min_train_micro_batch_size_per_gpu: PosInt = Field(1, description="Smallest micro-batch size tried.")
    max_train_micro_batch_size_per_gpu: PosInt = Field(1024, description="Largest micro-batch size tried.")
    tuner_type: Literal["gridsearch", "random", "model_based"] = Field(
        "gridsearch", description="Order of the trials: as generated, shuffled, or by a cost model fitted "
                                  "to the trials measured so far.")
    tuner_early_stopping: PosInt = Field(5, description="Stop after this many trials in a row without a "
                                                        "better metric.")
    tuner_num_trials: PosInt = Field(50, description="Most trials launched.")
    results_dir: str = Field("autotuning_results", description="Where the summary and ds_config_optimal.json "
                                                               "are written.")
    exps_dir: str = Field("autotuning_exps", description="Where each trial's config, logs and results go.")
    overwrite: bool = Field(True, description="Run a trial again even when exps_dir holds its result "
                                              "(false: reuse the result).")
    mp_size: PosInt = Field(1, description="Model-parallel ranks per replica; data-parallel ranks = world "
                                           "size / mp_size.")
    arg_mappings: Optional[dict[str, str]] = Field(
        None, description="Config key -> script argument given the trial's value too (e.g. "
                          "{\"train_micro_batch_size_per_gpu\": \"--batch_size\"}); the key "
                          "activation_checkpointing names a flag that makes activation checkpointing a "
                          "tuned setting (given true or false).")

    @model_validator(mode="after")
    def _profile_window(self) -> "AutotuningConfig":
        if self.end_profile_step <= self.start_profile_step:
            raise _Problem(f"end_profile_step ({self.end_profile_step}) must be above start_profile_step "
                           f"({self.start_profile_step}): the steps between them are timed", key="end_profile_step")
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise _Problem(f"max_train_micro_batch_size_per_gpu ({self.max_train_micro_batch_size_per_gpu}) is "
                           f"below min_train_micro_batch_size_per_gpu ({self.min_train_micro_batch_size_per_gpu})",
                           key="max_train_micro_batch_size_per_gpu")
        return self


class CommsLoggerConfig(_Section):
    """`comms_logger`: count and time the collectives of each step."""

    enabled: bool = Field(False, description="Record every collective (op, bytes, time).")
    verbose: bool = Field(False, description="Print each collective as it happens.")
    prof_all: bool = Field(True, description="Record all ops (false: only those in prof_ops).")
    prof_ops: list[str] = Field(default_factory=list, description="Ops to record when prof_all is "
                                                                  "false, e.g. [\"all_reduce\"].")
    debug: bool = Field(False, description="Also record the caller of each collective.")


class CompileConfig(_Section):
    """`compile`: DeepSpeed's settings for `engine.compile()`.

    dsrun's `engine.compile()` runs plain torch.compile (see
    dsrun/runtime/engine/compile.py); the keys below belong to DeepSpeed's
    own compiler, DeepCompile, and to its AutoEP regional mode, which dsrun
    does not implement: turning either on is refused at initialize, and the
    DeepCompile knobs do nothing while `deepcompile` is off (in DeepSpeed
    too).
    """

    deepcompile: bool = Field(False, description="DeepSpeed's DeepCompile (ZeRO as compiler passes); "
                                                 "not implemented by dsrun: must stay false.")
    autoep_non_moe: bool = Field(False, description="DeepSpeed: compile the parents of AutoEP layers only; "
                                                    "not implemented by dsrun: must stay false.")
    free_activation: bool = Field(False, description="DeepCompile: free activations early.")
    free_activation_threshold: Count = Field(10 * 1024 * 1024, description="DeepCompile: bytes from which "
                                                                           "activations are freed early.")
    offload_activation: bool = Field(False, description="DeepCompile: keep saved activations in host memory.")
    offload_activation_pin_memory: bool = Field(True, description="DeepCompile: pin those host buffers.")
    offload_opt_states: bool = Field(False, description="DeepCompile: offload optimizer states between steps.")
    double_buffer: bool = Field(True, description="DeepCompile: double-buffer gathered parameters.")
    symmetric_memory: bool = Field(False, description="DeepCompile: use symmetric memory for collectives.")
    debug_log: bool = Field(False, description="DeepCompile: dump the graphs.")
    offload_parameters: bool = Field(False, description="DeepCompile: offload parameters.")
    sync_before_reduce: bool = Field(False, description="DeepCompile: synchronize before each reduction.")
    sync_after_reduce: bool = Field(False, description="DeepCompile: synchronize after each reduction.")
    sync_before_allgather: bool = Field(False, description="DeepCompile: synchronize before each all-gather.")
    sync_after_allgather: bool = Field(False, description="DeepCompile: synchronize after each all-gather.")
    keep_int_input_tensors: bool = Field(True, description="DeepCompile: keep integer inputs' values when "
                                                           "profiling.")
    keep_all_input_tensors: bool = Field(False, description="DeepCompile: keep every input's values when "
                                                            "profiling.")
    passes: Optional[list[Literal["z1", "z3", "autosp", "autotp"]]] = Field(
        None, description="DeepCompile: the compiler passes to run.")


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
    use_node_local_storage: bool = Field(False, description="save_dir/load_dir name each node's own "
                                         "storage: each rank writes its files there, each node keeps a copy of "
                                         "the index and `latest` (see docs/checkpoints.md).")
    auto_resume: bool = Field(False, description="dsrun: initialize() loads the newest complete "
                              "checkpoint in save_dir when there is one (resharded to this world size; "
                              "rank 0 says from which step), else starts fresh and says so. Made for "
                              "`dsrun --max_restarts` (docs/restarts.md).")
    save_dir: Optional[str] = Field(None, description="dsrun: the directory auto_resume loads from (the "
                                    "one the script passes to save_checkpoint).")

    @model_validator(mode="after")
    def _resume_needs_dir(self) -> CheckpointConfig:
        if self.auto_resume and not self.save_dir:
            raise _Problem("auto_resume needs save_dir: the directory the script saves its checkpoints "
                           "in, e.g. \"checkpoint\": {\"auto_resume\": true, \"save_dir\": \"ckpt\"}",
                           key="save_dir")
        return self


def _micro_batch_list(value: Any) -> Any:
    """micro_batch_sizes: a non-empty list of positive integers (integral floats such as 4.0 read as 4)."""
    def whole(item: Any) -> bool:
        return (isinstance(item, int) and not isinstance(item, bool)) or (isinstance(item, float)
                                                                         and item.is_integer())
    if not isinstance(value, list) or not value or not all(whole(m) and m >= 1 for m in value):
        raise _Problem(f"expected a non-empty list of positive integers (samples per rank), got {value!r}")
    return [int(m) for m in value]


ELASTICITY_VERSIONS = (0.1, 0.2)


class ElasticityConfig(_Section):
    """`elasticity`: DeepSpeed's elastic training (dsrun.elasticity). The global batch size is
    chosen once from these keys so that every world size in a range can run it; the engine then
    sets the micro-batch and gradient accumulation for its data-parallel size (docs/elasticity.md).

    The docs' `prefer_large_batch` is read as `prefer_larger_batch`, with a warning.
    """

    enabled: bool = Field(False, description="Take train_batch_size, train_micro_batch_size_per_gpu and "
                                             "gradient_accumulation_steps from the elastic search below.")
    max_train_batch_size: PosInt = Field(2000, description="Largest global batch (samples) the search may "
                                         "choose; required when enabled.")
    micro_batch_sizes: Annotated[list[int], BeforeValidator(_micro_batch_list)] = Field(
        default_factory=lambda: [2, 4, 6], description="Micro-batch sizes a rank may run (samples); required "
                                                       "when enabled.")
    min_gpus: PosInt = Field(1, description="Smallest world size the batch must suit.")
    max_gpus: PosInt = Field(10000, description="Largest world size the batch must suit.")
    min_time: Count = Field(0, description="Minutes a job runs before a scheduler may resize it (for the "
                                           "scheduler; 0 = unknown).")
    prefer_larger_batch: bool = Field(True, description="Among batch sizes that suit equally many world sizes, "
                                                        "take the larger (the docs' prefer_large_batch "
                                                        "is read as this key).")
    ignore_non_elastic_batch_info: bool = Field(False, description="Allow the three batch keys beside an "
                                                "enabled elasticity section (they are then overridden); "
                                                "false: they are an error.")
    version: Annotated[float, _NUMBER] = Field(0.2, description="Search to use: 0.1 (world sizes) or 0.2 (node "
                                               "counts, with num_gpus_per_node and model_parallel_size).")
    num_gpus_per_node: PosInt = Field(1, description="Version 0.2: GPUs per node; world sizes are counted in "
                                                     "whole nodes.")
    model_parallel_size: PosInt = Field(1, description="Version 0.2: ranks per model replica (must divide "
                                                       "num_gpus_per_node); above 1 needs version 0.2.")

    @model_validator(mode="before")
    @classmethod
    def _docs_key_name(cls, data: Any) -> Any:
        """DeepSpeed's docs spell the key `prefer_large_batch`, which DeepSpeed itself ignores."""
        if not isinstance(data, Mapping) or "prefer_large_batch" not in data:
            return data
        data = dict(data)
        if "prefer_larger_batch" in data:
            raise _Problem("both 'prefer_large_batch' and 'prefer_larger_batch' are given; "
                           "'prefer_large_batch' is the docs' misspelling, keep only 'prefer_larger_batch'",
                           key="prefer_large_batch")
        warnings.warn("elasticity.prefer_large_batch (the spelling of DeepSpeed's docs) is read as "
                      "elasticity.prefer_larger_batch, the key DeepSpeed reads; rename it (DeepSpeed ignores "
                      "the misspelled key)", ConfigWarning, stacklevel=2)
        data["prefer_larger_batch"] = data.pop("prefer_large_batch")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "ElasticityConfig":
        missing = [k for k in ("max_train_batch_size", "micro_batch_sizes") if k not in self.model_fields_set]
        if self.enabled and missing:
            raise _Problem(f"{' and '.join(missing)} required when elasticity is enabled (the search has no "
                           "default for them)")
        if self.version not in ELASTICITY_VERSIONS:
            raise _Problem(f"unknown version {self.version:g}; dsrun implements DeepSpeed's elasticity "
                           f"versions 0.1 and 0.2", key="version")
        if self.max_gpus < self.min_gpus:
            raise _Problem(f"max_gpus ({self.max_gpus}) is below min_gpus ({self.min_gpus})", key="max_gpus")
        too_big = [m for m in self.micro_batch_sizes if m > self.max_train_batch_size]
        if too_big:
            raise _Problem(f"{too_big} exceed max_train_batch_size ({self.max_train_batch_size}); every "
                           "micro-batch must fit in the global batch", key="micro_batch_sizes")
        if self.model_parallel_size > 1 and self.version != 0.2:
            raise _Problem(f"model_parallel_size={self.model_parallel_size} needs version 0.2 (version "
                           f"{self.version:g} has no model parallelism)", key="model_parallel_size")
        if self.num_gpus_per_node % self.model_parallel_size:
            raise _Problem(f"num_gpus_per_node ({self.num_gpus_per_node}) is not a multiple of "
                           f"model_parallel_size ({self.model_parallel_size}); a model replica must fit "
                           "in a node", key="num_gpus_per_node")
        return self


class CurriculumScheduleConfig(_Section):
    """`schedule_config` of a curriculum: the keys each schedule_type needs
    (dsrun/runtime/data_pipeline/curriculum_scheduler.py [Note: the fixed schedules])."""

    total_curriculum_step: Optional[PosInt] = Field(
        None, description="fixed_linear/fixed_root: optimizer steps from min_difficulty to max_difficulty.")
    difficulty_step: Optional[PosInt] = Field(
        None, description="fixed_linear/fixed_root: every difficulty is rounded down to a multiple of this "
                          "(8 for fp16 Tensor Cores with the seqlen curriculum).")
    root_degree: Optional[PosReal] = Field(None, description="fixed_root: 2 = square root, 3 = cube root.")
    difficulty: Optional[list[Int]] = Field(None, description="fixed_discrete: the difficulties in order.")
    max_step: Optional[list[PosInt]] = Field(
        None, description="fixed_discrete: the last step of each difficulty but the last (one fewer entries).")


_SCHEDULE_KEYS = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
                  "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
                  "fixed_discrete": ("difficulty", "max_step"), "custom": ()}
ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]


def _check_curriculum_schedule(min_difficulty: Optional[int], max_difficulty: Optional[int],
                               schedule_type: Optional[str], schedule: CurriculumScheduleConfig) -> None:
    """The checks of an enabled curriculum; raises _Problem naming the key."""
    for key, value in (("min_difficulty", min_difficulty), ("max_difficulty", max_difficulty),
                       ("schedule_type", schedule_type)):
        if value is None:
            raise _Problem("required when the curriculum is enabled", key=key)
    if min_difficulty > max_difficulty:
        raise _Problem(f"min_difficulty ({min_difficulty}) is above max_difficulty ({max_difficulty})",
                       key="min_difficulty")
    for key in _SCHEDULE_KEYS[schedule_type]:
        if getattr(schedule, key) is None:
            raise _Problem(f"schedule_type {schedule_type!r} needs schedule_config.{key} "
                           f"(it needs {', '.join(_SCHEDULE_KEYS[schedule_type])})", key="schedule_config")
    if schedule_type == "fixed_discrete" and len(schedule.difficulty) != len(schedule.max_step) + 1:
        raise _Problem(f"fixed_discrete needs one more difficulty than max_step (the last difficulty holds "
                       f"after the last max_step); got {len(schedule.difficulty)} and {len(schedule.max_step)}",
                       key="schedule_config")


class CurriculumLearningConfig(_Section):
    """`curriculum_learning`: DeepSpeed's legacy sequence-length curriculum. While enabled, the engine
    passes `curriculum_seqlen=<difficulty>` to the model's forward in training (the model truncates its
    inputs); a PipelineEngine truncates the micro-batch itself (docs/curriculum.md)."""

    enabled: bool = Field(False, description="Run the curriculum.")
    curriculum_type: Literal["seqlen"] = Field("seqlen", description="What the difficulty is: seqlen "
                                               "(the sequence length; the only type DeepSpeed acts on).")
    min_difficulty: Optional[PosInt] = Field(None, description="Difficulty of the first step.")
    max_difficulty: Optional[PosInt] = Field(None, description="Difficulty at the end of the schedule.")
    schedule_type: Optional[ScheduleType] = Field(
        None, description="fixed_linear, fixed_root, fixed_discrete, or custom (a function set with "
                          "engine.set_custom_curriculum_learning_schedule).")
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig,
                                                      description="The schedule's parameters.")
    lr_schedule_in_tokens: bool = Field(
        False, description="dsrun: advance the LR scheduler by the tokens of each step in units of a full-length "
                           "step (curriculum_seqlen / max_difficulty per step), so that warmup_num_steps and "
                           "total_num_steps count full-length steps' worth of tokens (Megatron's "
                           "--lr-warmup-tokens / --lr-decay-tokens over the tokens of one full step).")

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> "CurriculumLearningConfig":
        if self.enabled:
            _check_curriculum_schedule(self.min_difficulty, self.max_difficulty, self.schedule_type,
                                       self.schedule_config)
        return self


class CurriculumMetricConfig(_Section):
    """One entry of `data_efficiency.data_sampling.curriculum_learning.curriculum_metrics`: a difficulty
    metric, computed in memory for every sample, and its schedule."""

    index_to_sample_path: Optional[str] = Field(
        None, description="DeepSpeed's offline-analyzer index file; dsrun computes metrics in memory and "
                          "refuses it (give metric_fn, or engine.deepspeed_io(..., difficulty_metrics=)).")
    index_to_metric_path: Optional[str] = Field(None, description="As index_to_sample_path.")
    metric_fn: Optional[str] = Field(
        None, description="dsrun: \"package.module:function\" called on each sample of the dataset, returning "
                          "its difficulty (a number); engine.deepspeed_io(difficulty_metrics=) may give the "
                          "function instead.")
    difficulty_type: Literal["value", "percentile"] = Field(
        "value", description="value: a sample is eligible when its metric <= the difficulty; percentile: when "
                             "it is among the easiest difficulty% of the dataset.")
    clustering_type: Literal["schedule_based", "single_cluster"] = Field(
        "schedule_based", description="schedule_based: the metric filters samples; single_cluster: every "
                                      "sample is eligible (the metric only runs its schedule).")
    min_difficulty: Optional[Int] = Field(None, description="Difficulty of the first step.")
    max_difficulty: Optional[Int] = Field(None, description="Difficulty at the end of the schedule (at most "
                                                            "100 for percentile).")
    schedule_type: Optional[ScheduleType] = Field(None, description="As curriculum_learning.schedule_type.")
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig,
                                                      description="The schedule's parameters.")

    def check(self) -> None:
        """The checks of a metric of an enabled curriculum (a disabled one may
        hold DeepSpeed's offline paths); raises _Problem naming the key."""
        for key in ("index_to_sample_path", "index_to_metric_path"):
            if getattr(self, key) is not None:
                raise _Problem("dsrun computes difficulty metrics in memory and reads no index files; remove "
                               "it and give metric_fn (\"module:function\" of a sample) or pass the function "
                               "to engine.deepspeed_io(..., difficulty_metrics={name: fn})", key=key)
        _check_curriculum_schedule(self.min_difficulty, self.max_difficulty, self.schedule_type,
                                   self.schedule_config)
        if self.difficulty_type == "percentile" and not 0 <= self.min_difficulty <= self.max_difficulty <= 100:
            raise _Problem(f"percentile difficulties lie in [0, 100], got min {self.min_difficulty} and max "
                           f"{self.max_difficulty}", key="max_difficulty")


class DataSamplingCurriculumConfig(_Section):
    """`data_efficiency.data_sampling.curriculum_learning`: sample each step only from the examples
    whose difficulty metrics are within the current difficulties."""

    enabled: bool = Field(False, description="Sample by curriculum.")
    data_cluster_path: Optional[str] = Field(
        None, description="DeepSpeed's directory for cluster files; dsrun keeps the clusters in memory.")
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(
        default_factory=dict, description="Metric name -> its difficulty type and schedule.")

    @model_validator(mode="after")
    def _some_metric(self) -> "DataSamplingCurriculumConfig":
        if self.enabled and not self.curriculum_metrics:
            raise _Problem("give at least one metric when the curriculum is enabled, e.g. {\"seqlen\": "
                           "{\"metric_fn\": ..., \"min_difficulty\": ..., ...}}", key="curriculum_metrics")
        if self.enabled:
            for name, metric in self.curriculum_metrics.items():
                try:
                    metric.check()
                except _Problem as problem:
                    raise _Problem(problem.text, key=f"curriculum_metrics.{name}.{problem.key}") from None
        return self


class DataSamplingConfig(_Section):
    """`data_efficiency.data_sampling`: how the engine's data loader picks samples."""

    enabled: bool = Field(False, description="Use the data-sampling features below.")
    num_epochs: PosInt = Field(1000, description="The curriculum loader ends after this many passes' worth "
                                                 "of samples.")
    num_workers: Count = Field(0, description="Data loader worker processes.")
    pin_memory: bool = Field(False, description="Pin the loader's batches in page-locked host memory.")
    curriculum_learning: DataSamplingCurriculumConfig = Field(
        default_factory=DataSamplingCurriculumConfig, description="Curriculum sampling by difficulty metrics.")

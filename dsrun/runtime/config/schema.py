"""`DsConfig`: the whole ds_config, its batch triple and the checks across sections."""
from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Optional

import annotated_types as at
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    model_validator,
)

from dsrun.runtime.config.errors import _Problem
from dsrun.runtime.data_pipeline.data_routing.config import DataRoutingConfig
from dsrun.runtime.config.sections import ActivationCheckpointingConfig, AioConfig, AutotuningConfig, Bf16Config, CheckpointConfig, CommsLoggerConfig, CompileConfig, Count, CurriculumLearningConfig, DataSamplingConfig, DataTypesConfig, ElasticityConfig, FlopsProfilerConfig, Fp16Config, Int, MonitorConfig, NonNegReal, _NUMBER, OptimizerConfig, PipelineConfig, PosInt, PosReal, SchedulerConfig, _Section, TensorParallelConfig, WandbConfig, ZeroConfig

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
    "compression_training": "compression training",
    "nebula": "Nebula checkpointing",
    "hybrid_engine": "the hybrid engine",
    "sparse_attention": "sparse attention",
    "eigenvalue": "eigenvalue computation",
    "progressive_layer_drop": "progressive layer drop",
    "comet": "Comet monitoring",
}


class DataEfficiencyConfig(_Section):
    """`data_efficiency`: DeepSpeed Data Efficiency (Li et al., AAAI 2024): curriculum data
    sampling (dsrun/runtime/data_pipeline/data_sampling.py) and data routing (random-LTD,
    dsrun/runtime/data_pipeline/data_routing/)."""

    enabled: bool = Field(False, description="Use the features below (each has its own switch too).")
    seed: Int = Field(1234, description="Seed of the curriculum sampler (the same on every rank).")
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig,
                                              description="Curriculum data sampling.")
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig,
                                            description="Random layerwise token dropping (random-LTD).")

    @model_validator(mode="after")
    def _switches_agree(self) -> "DataEfficiencyConfig":
        """A part's switch on with a switch above it off is refused: DeepSpeed's loader reads only
        the innermost switch, its documentation asks for all three; either reading would surprise."""
        if self.data_sampling.curriculum_learning.enabled and not (self.enabled and self.data_sampling.enabled):
            off = [k for k, v in (("enabled", self.enabled), ("data_sampling.enabled", self.data_sampling.enabled))
                   if not v]
            raise _Problem(f"data_sampling.curriculum_learning.enabled is true but {' and '.join(off)} "
                           "false; set all three to true to sample by curriculum, or the innermost to false",
                           key="data_sampling")
        if self.data_routing.random_ltd.enabled and not (self.enabled and self.data_routing.enabled):
            raise _Problem("random_ltd.enabled is true but data_efficiency.enabled or data_routing.enabled is "
                           "false; random-LTD runs only with all three set to true", key="data_routing")
        return self

    @property
    def curriculum_sampling(self) -> bool:
        """Whether the curriculum sampler runs (every switch on its path is on)."""
        return self.data_sampling.curriculum_learning.enabled


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
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig,
                                     description="Pipeline parallelism (with a PipelineModule).")
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig,
                                                  description="Automatic tensor parallelism (AutoTP).")
    sequence_parallel_size: PosInt = Field(1, description="Ulysses sequence parallelism: ranks that split "
                                           "each sample's tokens (the mesh's sequence axis; data parallelism "
                                           "takes the rest, and ZeRO partitions over data x sequence).")
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig,
                                                  description="Data efficiency: random-LTD.")
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
    compile: CompileConfig = Field(default_factory=CompileConfig, description="DeepSpeed's compiler settings "
                                   "(DeepCompile; engine.compile() takes its own arguments).")
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig,
                                         description="The autotuner (dsrun --autotuning tune|run).")
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig, description="Elastic training: the "
                                         "batch size chosen for a range of world sizes (dsrun.elasticity).")
    curriculum_learning: CurriculumLearningConfig = Field(
        default_factory=CurriculumLearningConfig, description="Legacy sequence-length curriculum "
                                                              "(docs/curriculum.md).")
    data_efficiency: DataEfficiencyConfig = Field(
        default_factory=DataEfficiencyConfig, description="Curriculum data sampling and data routing "
                                                          "(docs/curriculum.md).")

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

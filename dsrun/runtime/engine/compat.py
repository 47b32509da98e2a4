"""The parts of DeepSpeedEngine's surface that scripts and Hugging Face call
but that the training loop does not need: configuration getters, the
consolidated 16-bit state dict, attribute forwarding to the wrapped module,
and the pipeline engine's methods, which say what to do instead.

They live in this mixin so that engine.py stays the loop (see
the design notes: one engine class behind one-line getters is what to avoid). Every getter reads the resolved DsConfig
or the gradient strategy; none holds state of its own.
"""
from __future__ import annotations

from collections import OrderedDict

import torch




def _pipeline_only(name: str):
    """A method of DeepSpeed's PipelineEngine called on the data-parallel engine."""
    def method(self, *args, **kwargs):
        raise RuntimeError(
            f"engine.{name}() belongs to the pipeline engine, which initialize() returns when the model is "
            "a dsrun.pipe.PipelineModule; this model is a plain module: run forward, engine.backward(loss) "
            "and engine.step() per micro-batch (see README, 'Using dsrun in a training script')")
    method.__name__ = name
    method.__doc__ = f"Pipeline engine only (DeepSpeed's PipelineEngine.{name}); raises RuntimeError here."
    return method


class DeepSpeedEngineCompat:
    """DeepSpeedEngine's query methods, mixed into dsrun.runtime.engine.engine.Engine.

    Expects `self.config` (DsConfig), `self.strategy`, `self.module`,
    `self.topology` and `self.lr_scheduler`, which Engine sets.
    """

    # -- precision ---------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def fp16_auto_cast(self) -> bool:
        """Whether forward casts floating-point positional inputs to fp16
        (fp16.auto_cast, with fp16 enabled)."""
        return self.config.fp16.enabled and self.config.fp16.auto_cast

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    # -- curriculum (DeepSpeed's names) ----------------------------------------------------
    def curriculum_enabled_legacy(self) -> bool:
        """Whether the legacy `curriculum_learning` section is on."""
        return self.config.curriculum_learning.enabled

    def curriculum_params_legacy(self) -> dict:
        """The `curriculum_learning` section as a dict without "enabled" (DeepSpeed's form)."""
        return self.config.curriculum_learning.model_dump(mode="json", exclude={"enabled"})

    def curriculum_learning_enabled(self) -> bool:
        """Whether the data sampler's curriculum runs (every switch of its path on)."""
        return self.config.data_efficiency.curriculum_sampling

    def amp_enabled(self) -> bool:
        return False  # the amp section is not supported (config rejects it when enabled)

    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""
        precision = getattr(self.strategy, "precision", None)
        return float(precision.scaler.scale) if precision is not None else 1.0

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.enabled and self.config.fp16.loss_scale == 0

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype)."""
        precision = getattr(self.strategy, "precision", None)
        if precision is None:
            return torch.float32, torch.float32
        return precision.compute_dtype, precision.grad_accum_dtype

    @property
    def communication_data_type(self) -> torch.dtype:
        precision = getattr(self.strategy, "precision", None)
        return torch.float32 if precision is None else precision.comm_dtype

    # -- ZeRO ------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        """True when ZeRO partitions anything (stage > 0)."""
        return self.config.zero_optimization.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero_optimization.stage == 3

    def zero_reduce_bucket_size(self) -> int:
        return int(self.config.zero_optimization.reduce_bucket_size)

    def zero_allgather_bucket_size(self) -> int:
        return int(self.config.zero_optimization.allgather_bucket_size)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: dsrun's 16-bit export always gathers the full weights, at any
        stage, whatever stage3_gather_16bit_weights_on_model_save says."""
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The full model state dict in the compute dtype, on rank 0's CPU
        (collective: every rank calls it; parameters are gathered one at a
        time). Returns an OrderedDict on rank 0 and None on the others, as
        DeepSpeed does. Tied parameters appear once."""
        keep = self.topology.rank == 0
        state = OrderedDict() if keep else None
        for name, value in self.checkpointer.full_16bit_state(exclude_frozen_parameters):
            if keep:
                state[name] = value.detach().to("cpu", copy=True)
        return state

    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict

    # -- other settings ----------------------------------------------------------------------
    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self):
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def dump_state(self) -> bool:
        """Whether initialize printed the engine's configuration and state (config dump_state)."""
        return self.config.dump_state

    def optimizer_name(self) -> str | None:
        return self.config.optimizer.type if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: the size of the job's mesh's data axis (as
        DeepSpeed's, without the sequence-parallel ranks, over which
        gradients are averaged too: `seq_dp_world_size`)."""
        return self.mesh.size("data")

    @property
    def seq_dp_world_size(self) -> int:
        """Data x sequence-parallel ranks: those gradients are averaged over."""
        mesh = self.mesh
        return mesh.size("data") * mesh.size("sequence")

    @property
    def mp_world_size(self) -> int:
        """Tensor-parallel ranks (the mesh's model axis)."""
        return self.mesh.size("model")

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False):
        """The wrapped module's state_dict (at stage 3 use
        _zero3_consolidated_16bit_state_dict for full values)."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        return state

    # -- attribute forwarding ----------------------------------------------------------------
    def __getattr__(self, name: str):
        """Parameters, buffers and submodules as nn.Module finds them, then the
        wrapped module's attributes (DeepSpeed forwards, e.g.
        engine.gradient_checkpointing_enable()). Raises AttributeError naming
        both when neither has it."""
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
        modules = self.__dict__.get("_modules", {})
        if name != "module" and "module" in modules:
            try:
                return getattr(modules["module"], name)
            except AttributeError:
                pass
        raise AttributeError(f"neither the dsrun engine nor its module ({type(modules.get('module')).__name__}) "
                             f"has an attribute {name!r}")

    # -- DeepSpeed's pipeline engine (dsrun/runtime/engine/pipeline_engine.py) -------------------
    train_batch = _pipeline_only("train_batch")
    eval_batch = _pipeline_only("eval_batch")
    set_dataiterator = _pipeline_only("set_dataiterator")
    set_batch_fn = _pipeline_only("set_batch_fn")
    is_first_stage = _pipeline_only("is_first_stage")
    is_last_stage = _pipeline_only("is_last_stage")

"""What `dump_state: true` prints at the start of training.

DeepSpeed's engine prints its configuration on rank 0 and, with
`dump_state`, every attribute of the engine object (print_configuration).
An attribute dump of dsrun's engine would show object reprs, not settings,
so `describe_engine` writes what those attributes amount to instead: the
resolved configuration (every key, defaults included), then the engine's
state -- ranks, device, strategy, ZeRO stage, dtypes, loss scale, where
gradients are divided, batch sizes, parameters, optimizer and scheduler,
counters -- one `name ..... value` line each, as DeepSpeed's dump is laid
out.
"""
from __future__ import annotations

from typing import Any

import torch

from dsrun.runtime.optim.precision import GradientDivision

_WIDTH = 36  # names are padded with dots to this column


def _line(name: str, value: Any) -> str:
    return f"  {name} {'.' * max(_WIDTH - len(name), 3)} {value}"


def _leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested dict, sorted by key."""
    if isinstance(data, dict) and data:
        out = []
        for key in sorted(data):
            out.extend(_leaves(data[key], f"{prefix}{key}."))
        return out
    return [(prefix.rstrip("."), data)]


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter (ZeRO stage 3 leaves a partition in
    `param` and the full count in `ds_numel`)."""
    return getattr(param, "ds_numel", param.numel())


def describe_engine(engine) -> str:
    """The dump of `engine` (an Engine or PipelineEngine after construction)
    as one multi-line string: a "configuration:" section with every resolved
    config key and a "state:" section (see the module docstring)."""
    lines = [f"{type(engine).__name__} configuration:"]
    lines += [_line(key, value) for key, value in _leaves(engine.config.model_dump(mode="json"))]
    topology, strategy = engine.topology, engine.strategy
    model_dtype, accum_dtype = engine.get_data_types()
    before, after = GradientDivision.from_config(engine.config).divisors(engine.dp_world_size)
    params = list(engine.module.parameters())
    optimizer = strategy.optimizer
    state = {
        "rank": topology.rank,
        "world_size": topology.world_size,
        "dp_world_size": engine.dp_world_size,
        "device": topology.device,
        "strategy": type(strategy).__name__,
        "zero_stage": engine.zero_optimization_stage(),
        "compute_dtype": _dtype(model_dtype),
        "grad_accum_dtype": _dtype(accum_dtype),
        "communication_data_type": _dtype(engine.communication_data_type),
        "loss_scale": engine.loss_scale(),
        "dynamic_loss_scale": engine.dynamic_loss_scale(),
        "fp16_auto_cast": engine.fp16_auto_cast(),
        "gradient_divided_before_reduction_by": before,
        "gradient_divided_after_reduction_by": after,
        "gradient_clipping": engine.gradient_clipping(),
        "train_batch_size": engine.train_batch_size(),
        "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "parameters": sum(_numel(p) for p in params),
        "trainable_parameters": sum(_numel(p) for p in params if p.requires_grad),
        "optimizer": type(optimizer).__name__,
        "lr_scheduler": type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
    }
    for i, group in enumerate(optimizer.param_groups):
        for key in sorted(group):
            if key != "params":
                state[f"optimizer.param_groups.{i}.{key}"] = group[key]
    lines.append(f"{type(engine).__name__} state:")
    lines += [_line(name, value) for name, value in state.items()]
    return "\n".join(lines)

"""Mixed-precision policy and loss scaling.

`PrecisionPolicy` says which dtype each kind of tensor uses (compute,
master weights, gradient accumulation) and owns the loss scaler. The
scalers follow DeepSpeed's semantics so that an fp16 `ds_config.json` trains
the same way here (including on CPU, which DeepSpeed refuses for fp16).

[Note: dynamic loss scaling]
Scheme of Micikevicius et al., "Mixed Precision Training" (ICLR 2018), in
DeepSpeed's variant: the loss is multiplied by `scale` before backward. When
any gradient on any rank is inf/nan the step is skipped (optimizer AND LR
scheduler) and, once `hysteresis` overflows have been seen, the scale is
halved (never below `min_loss_scale`). After `loss_scale_window` steps in a
row without overflow the scale doubles and the hysteresis budget refills.
With `consecutive_hysteresis` the budget refills after every clean step, so
only consecutive overflows consume it. An overflow while the scale already
sits at `min_loss_scale` is an error: the run cannot make progress.

[Note: dividing around the reduction]
Averaging N ranks' gradients is a sum and a division by N; where the
division happens matters for 16-bit numerics, so DeepSpeed lets a config
move it (engine.allreduce_bucket, stage_1_and_2's
gradient_reduction_w_predivide): with `prescale_gradients` each rank
divides by N before the sum; otherwise it divides by
`gradient_predivide_factor` f before and by N/f after (f = 1: the plain
sum-then-divide). A scaled fp16 gradient whose N-fold sum exceeds 65504
overflows in the sum unless divided first: an overflow there is an
overflow of the step (skipped, loss scale lowered), as in DeepSpeed. dsrun
divides in the accumulation dtype (fp32 by default), before the cast to
the communication dtype, so the cast cannot overflow either (DeepSpeed
casts first and accumulates in the compute dtype anyway). Unlike
DeepSpeed's stages 1-3, which refuse both settings with their
reduce-scatter, dsrun applies them at every stage.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch


class LossScaleUnderflowError(RuntimeError):
    """fp16 gradients keep overflowing although the loss scale is at its minimum."""


class LossScaler:
    """Static loss scaler (also the base class): `scale` never changes.

    `update(overflow)` records one optimizer step and returns True when the
    step must be applied (no overflow). A static scaler skips overflowing
    steps too but never changes its scale.
    """

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if scale <= 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self.scale = float(scale)

    def update(self, overflow: bool) -> bool:
        return not overflow

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler (see [Note: dynamic loss scaling]).

    init_scale: starting scale (2**initial_scale_power); window: clean steps
    before the scale grows (loss_scale_window); hysteresis: overflows
    tolerated before the scale shrinks; consecutive_hysteresis: refill the
    budget after each clean step; min_scale: floor (min_loss_scale).
    Raises LossScaleUnderflowError from `update` on an overflow at the floor.
    """

    dynamic = True

    def __init__(self, init_scale: float = 2.0 ** 16, window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, factor: float = 2.0):
        super().__init__(init_scale)
        if window < 1 or hysteresis < 1 or min_scale <= 0 or factor <= 1:
            raise ValueError("dynamic loss scaler needs loss_scale_window >= 1, hysteresis >= 1, "
                             f"min_loss_scale > 0 (got window={window}, hysteresis={hysteresis}, "
                             f"min_scale={min_scale})")
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.factor = factor
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> bool:
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale <= self.min_scale:
                    raise LossScaleUnderflowError(
                        f"fp16 gradients overflowed at the minimum loss scale {self.min_scale:g}; "
                        "training cannot progress. Try bf16 (\"bf16\": {\"enabled\": true}), a lower "
                        "learning rate, gradient_clipping, or a smaller fp16.min_loss_scale.")
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1
        return not overflow

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left,
                "iteration": self.iteration, "last_overflow_iteration": self.last_overflow_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])


@dataclass(frozen=True)
class GradientDivision:
    """Where the division of a gradient average happens (see [Note: dividing
    around the reduction]).

    prescale: divide by the data-parallel size before the sum
        (`prescale_gradients`); `predivide_factor` is then ignored, as in
        DeepSpeed.
    predivide_factor: f > 0; divide by f before the sum and by N/f after
        (`gradient_predivide_factor`).
    """

    prescale: bool = False
    predivide_factor: float = 1.0

    def __post_init__(self) -> None:
        if not self.predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {self.predivide_factor}")

    def divisors(self, world_size: int) -> tuple[float, float]:
        """(before, after): the gradient is divided by `before` ahead of the
        sum over `world_size` ranks and the sum by `after`; before x after
        = world_size. A divisor of 1.0 means no division."""
        if self.prescale:
            return float(world_size), 1.0
        return self.predivide_factor, world_size / self.predivide_factor

    @classmethod
    def from_config(cls, cfg: Any) -> "GradientDivision":
        """From a DsConfig's `prescale_gradients` and `gradient_predivide_factor`
        (absent keys: the defaults)."""
        return cls(bool(getattr(cfg, "prescale_gradients", False)),
                   float(getattr(cfg, "gradient_predivide_factor", 1.0)))


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PrecisionPolicy:
    """Which dtype each tensor kind uses.

    compute_dtype: model parameters and activations (fp32, bf16 or fp16).
    master_dtype: the optimizer's copy of the weights (always fp32 here).
    grad_accum_dtype: gradients accumulated and reduced across micro-batches
    (data_types.grad_accum_dtype; fp32 by default, which is more accurate
    than DeepSpeed's default of the compute dtype).
    scaler: loss scaler; a static scale of 1 when not fp16.
    comm_dtype: gradients are reduced across ranks in this dtype
    (communication_data_type; DeepSpeed's default, the compute dtype, so a
    bf16 run sends 2 bytes per gradient element, half of fp32). The shared-
    memory transport sums 16-bit values in fp32 and rounds once.
    division: where the reduction's averaging divides (see [Note: dividing
    around the reduction]).
    """

    compute_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    scaler: LossScaler = field(default_factory=LossScaler)
    comm_dtype: torch.dtype = torch.float32
    division: GradientDivision = field(default_factory=GradientDivision)

    @property
    def mixed(self) -> bool:
        """True when the optimizer needs a separate master copy."""
        return self.compute_dtype != self.master_dtype

    @property
    def name(self) -> str:
        return {v: k for k, v in _DTYPES.items()}[self.compute_dtype]

    @classmethod
    def from_config(cls, cfg: Any) -> "PrecisionPolicy":
        """Build from a DsConfig (its fp16, bf16 and data_types sections).

        Raises ValueError when fp16 and bf16 are both enabled.
        """
        fp16, bf16 = cfg.fp16, cfg.bf16
        if fp16.enabled and bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        compute = torch.float16 if fp16.enabled else torch.bfloat16 if bf16.enabled else torch.float32
        accum_name = getattr(getattr(cfg, "data_types", None), "grad_accum_dtype", None)
        accum = _DTYPES[accum_name] if accum_name else torch.float32
        scaler: LossScaler = LossScaler()
        if fp16.enabled:
            if fp16.loss_scale and fp16.loss_scale > 0:
                scaler = LossScaler(fp16.loss_scale)
            else:
                scaler = DynamicLossScaler(
                    init_scale=2.0 ** fp16.initial_scale_power, window=fp16.loss_scale_window,
                    hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
                    min_scale=fp16.min_loss_scale)
        comm_name = getattr(cfg, "communication_data_type", None)
        return cls(compute, torch.float32, accum, scaler, _DTYPES[comm_name] if comm_name else compute,
                   GradientDivision.from_config(cfg))


def first_nonfinite(named_tensors) -> str | None:
    """Name of the first tensor holding inf or nan, or None. Costs one
    reduction per tensor; call it only after an overflow was detected."""
    for name, t in named_tensors:
        if t is not None and not torch.isfinite(t).all():
            return name
    return None


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating-point tensor in it cast to `dtype`
    (fp16.auto_cast: DeepSpeed's engine casts the positional inputs of
    forward to fp16 this way).

    Lists and tuples (namedtuples too) are rebuilt with the same type and
    dicts shallow-copied (same type, same keys), nested to any depth; other
    tensors (integer, bool) and other objects are returned as they are. The
    caller's containers are not modified.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple takes its fields as arguments
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for key, v in value.items():
            out[key] = cast_floating(v, dtype)
        return out
    return value

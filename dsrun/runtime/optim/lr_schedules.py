"""DeepSpeed's learning-rate schedules, with its parameter names, defaults and formulas.

Each schedule is stepped once per optimizer step (after it) and writes the
learning rate of every optimizer parameter group. `last_batch_iteration`
(t below) counts the steps taken; t = -1 before the first. Like DeepSpeed,
construction with t = -1 already writes the starting learning rate into the
optimizer, so the first optimizer step uses it.

Formulas (w = warmup_num_steps, clamped to >= 2; T = total_num_steps):
    warmup gamma(t) = log(t+1)/log(w)   (warmup_type "log")
                    = t/w               (warmup_type "linear")      for t < w
    WarmupLR:       lr = min + (max-min)*gamma(t); gamma = 1 for t >= w
    WarmupDecayLR:  as WarmupLR; for t >= w gamma = max(0, (T-t)/max(1, T-w))
    WarmupCosineLR: lr = base_lr * r(t); warmup r = wmin + (1-wmin)*gamma(t);
                    after: p = min(1, (t-w+1)/max(1, T-w)),
                    r = max(0, cmin + (1-cmin)*(1+cos(pi*p))/2)
    LRRangeTest:    lr = min_lr * (1 + rate * i), i = (t+1)/step_size
                    (floored when staircase)
    OneCycle:       see `OneCycle`.
Sources: DeepSpeed `deepspeed/runtime/optim/lr_schedules.py` (docs: "Learning
Rate Schedulers"); OneCycle from Smith 2018, "A disciplined approach to
neural network hyper-parameters: Part 1" (arXiv:1803.09820).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from dsrun.runtime.config import ConfigError

WARMUP_TYPES = ("log", "linear")


class Schedule:
    """Base: step()/get_lr()/get_last_lr()/state_dict()/load_state_dict().

    Subclasses implement `get_lr()` for the current `last_batch_iteration`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = [g["lr"] for g in optimizer.param_groups]

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = list(lrs)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to `last_batch_iteration` (default: one more) and write the lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The learning rates written by the last step (or construction)."""
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply(self.get_lr())


def _per_group(optimizer: torch.optim.Optimizer, value, name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"scheduler.params.{name}: {len(value)} values given for "
                              f"{n} optimizer parameter groups; give one value or {n}")
        return [float(v) for v in value]
    return [float(value)] * n


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ConfigError(f"scheduler.params.warmup_num_steps: must be a positive integer, "
                          f"got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise ConfigError(f"scheduler.params.warmup_type: {warmup_type!r} is not one of "
                          f"{', '.join(WARMUP_TYPES)}")


def _warmup_gamma(t: int, w: int, warmup_type: str) -> float:
    """Fraction of the warmup done at step t < w (see module docstring)."""
    if warmup_type == "log":
        return math.log(t + 1) / math.log(w)
    return t / w


class WarmupLR(Schedule):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold.

    Defaults: warmup_min_lr 0, warmup_max_lr = the optimizer's lr, 1000 steps, "log".
    """

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps.

    Defaults: warmup_min_lr 0, warmup_max_lr 0.001, 1000 steps, "log".
    """

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0,
                 warmup_max_lr=0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                         warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - t)
                   / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(Schedule):
    """Warm up the ratio from warmup_min_ratio to 1, then cosine-decay it to cos_min_ratio.

    The ratio multiplies each group's lr at construction. Defaults:
    warmup_min_ratio 0, 1000 warmup steps, cos_min_ratio 1e-4, "log".
    """

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def get_lr_ratio(self) -> float:
        """The factor applied to each group's original lr at the current step."""
        t, w = self.last_batch_iteration, self.warmup_num_steps
        if t < 0:
            return 0.0
        if t < w:
            gamma = _warmup_gamma(t, w, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - w + 1) / max(1, self.total_num_steps - w))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(Schedule):
    """Grow the lr from lr_range_test_min_lr by lr_range_test_step_rate per step_size steps.

    Defaults: min_lr 1e-3, step_size 2000, step_rate 1.0, staircase False.
    """

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1) -> None:
        if lr_range_test_step_size <= 0:
            raise ConfigError("scheduler.params.lr_range_test_step_size: must be > 0, got "
                              f"{lr_range_test_step_size}")
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


class OneCycle(Schedule):
    """1Cycle: lr up from cycle_min_lr to cycle_max_lr and back, then optional decay.

    With n = last_batch_iteration + 1, cycle length L = first + second step
    sizes and x = n/L - floor(n/L) (position in the cycle), the scale s is
    x/r while x <= r (r = first/L), else (x-1)/(r-1). A stair count k > 0
    holds s on floor(position*k)/k within that half. In the cycle (t < L):
        lr = min_lr + (max_lr - min_lr)*s;  beta1 = max_mom - (max_mom - min_mom)*s
    After it, with d = t - L + 1 and decay_step_size D > 0:
        lr = min_lr / (1 + decay_lr_rate*d/D);  beta1 = max_mom*(1 + decay_mom_rate*d/D)
    (D = 0 or a zero rate: hold min_lr / max_mom.) Momentum cycles only when
    the optimizer has `betas` (beta2 is set to 0.99, as DeepSpeed does).
    """

    def __init__(self, optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        if cycle_first_step_size <= 0 or (cycle_second_step_size or 1) <= 0:
            raise ConfigError("scheduler.params.cycle_first_step_size/cycle_second_step_size: "
                              "must be > 0")
        super().__init__(optimizer, last_batch_iteration)
        self.first = float(cycle_first_step_size)
        self.second = float(cycle_second_step_size if cycle_second_step_size is not None
                            else cycle_first_step_size)
        self.total = self.first + self.second
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = (cycle_first_stair_count if cycle_second_stair_count is None
                              else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.min_mom, self.max_mom = cycle_min_mom, cycle_max_mom
        self.decay_mom_rate = decay_mom_rate
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)
            self._apply_mom(self.min_mom)

    def _scale(self) -> float:
        n = self.last_batch_iteration + 1
        ratio = self.first / self.total
        x = n / self.total - math.floor(n / self.total)
        if x <= ratio:
            scale, stairs = x / ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (ratio - 1), self.second_stairs
        if stairs > 0:
            # Quantise from the integer position, not from `scale`, which may sit
            # a rounding error below an exact stair.
            pos = n % self.total
            if pos <= self.first:
                scale = math.floor(pos * stairs / self.first) / stairs
            else:
                scale = math.floor((self.total - pos) * stairs / self.second) / stairs
        return scale

    def _decay_interval(self) -> float | None:
        if self.decay_step_size == 0:
            return None
        return (self.last_batch_iteration - self.total + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        d = self._decay_interval()
        if d is None:
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * d) for lo in self.min_lrs]

    def get_mom(self) -> float:
        """beta1 at the current step."""
        if self.last_batch_iteration < self.total:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale()
        d = self._decay_interval()
        return self.max_mom if d is None else self.max_mom * (1 + self.decay_mom_rate * d)

    def _apply_mom(self, beta1: float) -> None:
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (beta1, 0.99)

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        self._apply_mom(self.get_mom())


SCHEDULES = {cls.__name__: cls for cls in
             (WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest, OneCycle)}
# DeepSpeed's name for the list of schedule names (Hugging Face's integration reads it).
VALID_LR_SCHEDULES = list(SCHEDULES)


def build_lr_scheduler(sched_type: str, options: dict[str, Any],
                       optimizer: torch.optim.Optimizer) -> Schedule:
    """Build DeepSpeed schedule `sched_type` with `options` (`scheduler.params`).

    Raises:
        ConfigError: unknown type, unknown or missing parameter.
    """
    cls = SCHEDULES.get(sched_type)
    if cls is None:
        raise ConfigError(f"scheduler.type: unknown schedule {sched_type!r}; "
                          f"available: {', '.join(SCHEDULES)}")
    accepted = [n for n in cls.__init__.__code__.co_varnames[1:cls.__init__.__code__.co_argcount]
                if n != "optimizer"]
    for key in options:
        if key not in accepted:
            raise ConfigError(f"scheduler.params.{key}: not a parameter of {sched_type}; "
                              f"accepted: {', '.join(accepted)}")
    try:
        return cls(optimizer, **options)
    except TypeError as exc:
        raise ConfigError(f"scheduler.params: {sched_type} {exc}") from None

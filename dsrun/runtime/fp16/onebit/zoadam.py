"""0/1 Adam (`"type": "ZeroOneAdam"`), at DeepSpeed's path deepspeed.runtime.fp16.onebit.zoadam.

Lu et al., "Maximizing Communication Efficiency for Large-scale Training
via 0/1 Adam" (ICLR 2023), Algorithm 1, with DeepSpeed's arithmetic and
schedules. Per tensor θ with gradient g, momentum m, variance v:

- Adaptive variance freezing (steps up to var_freeze_step + 1, DeepSpeed's
  count): the variance
  is updated only on steps t with t % var_interval == 0, from the engine's
  all-reduced gradient (v = β2·v + (1-β2)·g², m = β1·m + (1-β1)·g); on the
  other steps the ranks exchange g itself 1-bit compressed and update m
  only. var_interval starts at 1 and doubles after every var_update_scaler
  variance updates, so full all-reduces become exponentially rarer.
- Local steps (from step var_freeze_step + 2): v is frozen; each rank updates m
  and θ with its local gradient and sends nothing, accumulating
  u = Σ -lr·(update) and Σ lr (per tensor). Every local_step_interval steps the ranks
  synchronise: θ is rolled back by u, u is rescaled by (√v + eps), averaged
  1-bit compressed, m = -u/Σlr and θ += u/(√v + eps). local_step_interval
  starts at 1 and doubles every local_step_scaler steps, up to
  local_step_clipper.
- Each step: θ ← θ - lr·(m/(√v + eps) + weight_decay·θ).

Between synchronisations the ranks' parameters differ (that is the
method); a checkpoint taken then stores pieces from different ranks.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from dsrun.runtime import comm
from dsrun.runtime.fp16.onebit.adam import apply_update, check_adam_args, denominator
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer, adam_state

log = logging.getLogger("dsrun.onebit")


class ZeroOneAdam(CompressedCommOptimizer):
    """0/1 Adam with DeepSpeed's signature (module docstring).

    Args:
        params: parameters or parameter-group dicts.
        deepspeed: ignored (dsrun's engine attaches itself).
        lr, bias_correction (accepted, not applied as in DeepSpeed), betas,
            eps, eps_inside_sqrt, weight_decay, max_grad_norm (unused),
            amsgrad (must be False): as OnebitAdam.
        var_freeze_step: the variance may be updated up to step
            var_freeze_step + 1, local steps follow (100000).
        var_update_scaler: variance updates per doubling of var_interval (16).
        local_step_scaler: steps per doubling of local_step_interval (32678).
        local_step_clipper: largest local_step_interval (16).
        cuda_aware, comm_backend_name: accepted (see OnebitAdam).

    Raises:
        ValueError: bad hyperparameters (before any communication).
    """

    def __init__(self, params, deepspeed=None, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        check_adam_args("ZeroOneAdam", lr, betas, eps, amsgrad)
        for key, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                           ("local_step_clipper", local_step_clipper)):
            if int(value) < 1:
                raise ValueError(f"ZeroOneAdam: {key} must be >= 1, got {value}")
        if var_freeze_step < 0:
            raise ValueError(f"ZeroOneAdam: var_freeze_step must be >= 0, got {var_freeze_step}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, max_grad_norm=max_grad_norm))
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self._setup_comm(cuda_aware, comm_backend_name)
        self._accumulators: dict[tuple[int, int], torch.Tensor] = {}  # u per tensor, rank-local

    def _schedule(self) -> dict:
        """The scalar schedule state (kept in the first tensor's state so checkpoints carry it)."""
        first = self.param_groups[0]["params"][0]
        state = adam_state(self, first)
        for key, start in (("global_step", 0), ("var_interval", 1), ("var_counter", 0),
                           ("local_step_interval", 1), ("local_step_counter", 0)):
            state.setdefault(key, start)
        return state

    def steps_done(self) -> int:
        return int(self._schedule()["global_step"])

    def variance_frozen(self) -> bool:
        """True from step var_freeze_step + 2 on (local steps): DeepSpeed
        freezes once more than var_freeze_step steps are done."""
        return self.steps_done() > self.var_freeze_step

    def gradients_averaged(self) -> bool:
        return not self.variance_frozen() and (self.steps_done() + 1) % self._schedule()["var_interval"] == 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One 0/1 Adam step (collective on compressed and synchronising steps)."""
        loss = self.closure_loss(closure)
        sched = self._schedule()
        frozen = self.variance_frozen()
        if frozen and self.steps_done() == self.var_freeze_step + 1:
            self.reset_errors()  # errors of gradients do not carry over to accumulated momenta
            if comm.get_rank() == 0:
                log.info("ZeroOneAdam: step %d: variance frozen, local steps from now on", self.steps_done() + 1)
        t = self.steps_done() + 1
        var_step = not frozen and t % sched["var_interval"] == 0
        sync = frozen and t % sched["local_step_interval"] == 0
        world = self.world_size()
        for gi, pi, group, p, state in self._stepped():
            state.setdefault("lrs", 0.0)
            beta1, beta2 = group["betas"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            g = p.grad.float()
            if var_step:
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            elif not frozen and world > 1:
                g = self.compressed_mean((gi, pi), group, p, g.clone())
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            denom = denominator(v, group["eps"], self.eps_inside_sqrt)
            update = m / denom
            if group["weight_decay"] > 0:
                update.add_(p.float(), alpha=group["weight_decay"])
            apply_update(p, update, group["lr"])
            if not frozen:
                continue
            u = self._accumulators.get((gi, pi))
            if u is None:
                u = self._accumulators[(gi, pi)] = torch.zeros_like(m)
            u.add_(update, alpha=-group["lr"])
            state["lrs"] += group["lr"]
            if sync:
                apply_update(p, u, 1.0)          # roll back the local steps
                u.mul_(denom)
                if world > 1:
                    self.compressed_mean((gi, pi), group, p, u)
                m.copy_(u).div_(-state["lrs"])
                apply_update(p, u / denom, -1.0)  # the synchronised update
                u.zero_()
                state["lrs"] = 0.0
        sched["global_step"] += 1
        if frozen:
            sched["local_step_counter"] += 1
            if sched["local_step_counter"] == self.local_step_scaler:
                sched["local_step_counter"] = 0
                sched["local_step_interval"] = min(self.local_step_clipper, sched["local_step_interval"] * 2)
        elif var_step:
            sched["var_counter"] += 1
            if sched["var_counter"] == self.var_update_scaler:
                sched["var_counter"] = 0
                sched["var_interval"] *= 2
        return loss

    # ---- checkpoints: the accumulators are rank-local --------------------------------
    def _extra_tensors(self) -> dict[str, torch.Tensor]:
        return {f"g{gi}.t{pi}.momentum_accumulator": u for (gi, pi), u in sorted(self._accumulators.items())}

    def _extra_names(self) -> tuple[str, ...]:
        return ("momentum_accumulator",)

    def _clear_extras(self) -> None:
        self._accumulators.clear()

    def _restore_extra(self, index: tuple[int, int], name: str, value: torch.Tensor) -> None:
        params = dict(((gi, pi), p) for gi, pi, _, p in self._indexed())
        self._accumulators[index] = value.float().reshape(params[index].shape).clone()

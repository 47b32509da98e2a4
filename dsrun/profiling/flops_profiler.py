"""FLOPs, MACs, parameters and latency of a model's forward, per module.

DeepSpeed's flops profiler API (`deepspeed.profiling.flops_profiler`):

    prof = FlopsProfiler(model)
    prof.start_profile()
    model(batch)
    prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    prof.print_model_profile(module_depth=2, top_modules=3)
    prof.end_profile()

or in one call, `get_model_profile(model, input_shape=(8, 128))`, and in
training with the config section `flops_profiler` (the engine profiles the
forward of one step and prints the report on rank 0).

[Note: what is counted]
FLOPs come from PyTorch's own counter (`torch.utils.flop_counter.
FlopCounterMode`), which sees every aten op after dispatch and counts the
ops of its registry: matrix multiplications (mm, addmm, bmm, baddbmm),
convolutions and fused attention, at 2 FLOPs per multiply-accumulate
(MAC), so MACs = FLOPs / 2. dsrun adds the formula for the CPU fused
attention kernel, which the registry lacks. Element-wise ops (activations,
normalisation, softmax outside fused attention, bias adds) are not counted;
in a transformer they are well under 1% of the matmul FLOPs, and they are
where DeepSpeed's hand-written table and PyTorch's counter disagree. A
Linear(in, out) on a (B, in) input is 2*B*in*out FLOPs with or without bias.

Latency per module is wall time between its forward pre-hook and forward
hook (CUDA is synchronized at each so kernels are timed, not launches), so
it includes Python overhead, which dominates for tiny modules. Parameters
per module are counted recursively (a module's own and its children's).
"""
from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["FlopsProfiler", "ModuleProfile", "get_model_profile", "number_to_string"]

_aten = torch.ops.aten


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,
                            out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# Fused attention on CPU (scaled_dot_product_attention without a mask), absent from torch's registry.
_EXTRA_FORMULAS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
}


@functools.cache
def _warm_up_counter() -> None:
    """Enter FlopCounterMode once outside any profile: its first use in a process
    costs about 2 s of one-time set-up, which would land in the first
    module's latency."""
    with FlopCounterMode(display=False):
        torch.mm(torch.ones(1, 1), torch.ones(1, 1))


def number_to_string(value: float, unit: str = "", precision: int = 2) -> str:
    """1234567 -> "1.23 M" (+ unit); powers of 1000 from "" to "P", and "m"/"u" for seconds."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, "")):
        if abs(value) >= scale:
            if scale == 1.0 and float(value).is_integer():
                return f"{int(value)} {unit}".rstrip()
            return f"{value / scale:.{precision}f} {prefix}{unit}"
    for scale, prefix in ((1e-3, "m"), (1e-6, "u")):
        if abs(value) >= scale:
            return f"{value / scale:.{precision}f} {prefix}{unit}"
    return f"{value:.{precision}f} {unit}"


@dataclass
class ModuleProfile:
    """What one module did in the profiled forward passes.

    Attributes:
        name: qualified name in the model ("" for the model itself).
        type_name: the module's class name.
        depth: 0 for the model, 1 for its children, ...
        params: parameters of the module and its children (elements).
        flops: floating-point operations of its forward (see [Note: what is counted]).
        duration: seconds spent in its forward, summed over calls.
        calls: forward calls profiled.
        children: direct submodules' names.
    """

    name: str
    type_name: str
    depth: int
    params: int
    flops: int = 0
    duration: float = 0.0
    calls: int = 0
    children: list[str] = field(default_factory=list)

    @property
    def macs(self) -> int:
        """Multiply-accumulates: FLOPs / 2 for every counted op."""
        return self.flops // 2


class FlopsProfiler:
    """Profiles the forward passes of `model` run between start_profile and stop_profile.

    Args:
        model: the module to profile (any nn.Module; an engine's `module`).
        ds_engine: accepted for DeepSpeed's signature; unused.
        recompute_fwd_factor: extra forward passes per step spent on
            activation recomputation (0 none, 1 full); it enters the backward
            FLOPs of the training summary, as in DeepSpeed.

    Use the totals after `stop_profile()` and before `end_profile()`.
    """

    def __init__(self, model: torch.nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._counter: FlopCounterMode | None = None
        self._hooks: list[Any] = []
        self._profiles: dict[str, ModuleProfile] = {}
        self._by_module: dict[int, ModuleProfile] = {}
        self._open: dict[int, list[float]] = {}
        self._t0 = 0.0
        self._duration = 0.0
        self._flops_by_name: dict[str, int] = {}
        self._sync = any(p.is_cuda for p in model.parameters())

    # -- profiling --------------------------------------------------------------------------
    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Start counting FLOPs and timing every module's forward (drops an earlier profile).

        Args:
            ignore_list: module classes to leave out of the per-module
                table (their FLOPs still count for their parents).
        """
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        for name, module in self.model.named_modules():
            depth = 0 if not name else name.count(".") + 1
            prof = ModuleProfile(name, type(module).__name__, depth,
                                 params=sum(p.numel() for p in module.parameters()),
                                 children=[f"{name}.{c}" if name else c for c, _ in module.named_children()])
            self._profiles[name] = prof
            if isinstance(module, ignored) and name:
                continue
            self._by_module[id(module)] = prof
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook))
            self._hooks.append(module.register_forward_hook(self._post_hook))
        _warm_up_counter()
        self._counter = FlopCounterMode(display=False, depth=sys.maxsize, custom_mapping=_EXTRA_FORMULAS)
        self._counter.__enter__()
        self._synchronize()
        self._t0 = time.perf_counter()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; totals and the per-module table stay until `end_profile`/`reset_profile`."""
        if not self.started:
            return
        self._synchronize()
        self._duration += time.perf_counter() - self._t0
        self._counter.__exit__(None, None, None)
        root = type(self.model).__name__
        for key, ops in self._counter.get_flop_counts().items():
            if key == "Global":
                continue
            name = key[len(root) + 1:] if key.startswith(root + ".") else ("" if key == root else None)
            if name is not None:
                self._flops_by_name[name] = self._flops_by_name.get(name, 0) + int(sum(ops.values()))
        self._total_flops = int(self._counter.get_total_flops())
        for name, prof in self._profiles.items():
            prof.flops = self._flops_by_name.get(name, 0)
        if "" in self._profiles:
            self._sum_containers("")
        self._remove_hooks()
        self.started = False

    def _sum_containers(self, name: str) -> tuple[int, float]:
        """A module whose forward never ran (ModuleList, ModuleDict) gets its children's sums."""
        prof = self._profiles[name]
        sums = [self._sum_containers(child) for child in prof.children]
        if prof.calls == 0 and prof.flops == 0:
            prof.flops = sum(f for f, _ in sums)
            prof.duration = sum(d for _, d in sums)
        return prof.flops, prof.duration

    def reset_profile(self) -> None:
        """Forget counts and timings (hooks stay if profiling)."""
        self._profiles, self._by_module, self._open = {}, {}, {}
        self._flops_by_name, self._duration, self._total_flops = {}, 0.0, 0

    def end_profile(self) -> None:
        """Stop (if running) and release everything the profiler attached to the model."""
        if self.started:
            self.stop_profile()
        self._remove_hooks()
        self.reset_profile()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _synchronize(self) -> None:
        if self._sync:
            torch.cuda.synchronize()

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self._synchronize()
        self._open.setdefault(id(module), []).append(time.perf_counter())

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._synchronize()
        starts = self._open.get(id(module))
        if starts:
            prof = self._by_module[id(module)]
            prof.duration += time.perf_counter() - starts.pop()
            prof.calls += 1

    # -- totals (DeepSpeed's getters) -------------------------------------------------------
    def get_total_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of the profiled forward passes (all of them, the whole model)."""
        return number_to_string(self._total_flops) if as_string else self._total_flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulates of the profiled forward passes (FLOPs / 2)."""
        macs = self._total_flops // 2
        return number_to_string(macs, "MACs") if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model (elements; this rank's shard under ZeRO-3)."""
        params = sum(p.numel() for p in self.model.parameters())
        return number_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds between start_profile and stop_profile."""
        return number_to_string(self._duration, "s") if as_string else self._duration

    def module_profiles(self) -> dict[str, ModuleProfile]:
        """The per-module results, keyed by qualified name ("" = the model)."""
        return dict(self._profiles)

    # -- report ---------------------------------------------------------------------------------
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None,
                            step_timing: dict[str, float] | None = None) -> None:
        """Print the summary, the top modules per depth and (detailed) the module tree.

        Args:
            profile_step: the training step the profile belongs to (shown in the title).
            module_depth: deepest level of the tree to show; -1 = all.
            top_modules: modules listed per depth in the aggregated part.
            detailed: print the module tree with every module's figures.
            output_file: write to this file instead of stdout (overwritten).
            step_timing: training only: {"forward", "backward", "step"}
                seconds and "batch_size" of the profiled step; adds the
                backward and iteration lines (backward FLOPs = (2 +
                recompute_fwd_factor) x forward FLOPs, as DeepSpeed assumes).
        """
        text = "\n".join(self._report_lines(profile_step, module_depth, top_modules, detailed, step_timing))
        if output_file:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            print(text, flush=True)

    def _report_lines(self, profile_step: int, module_depth: int, top_modules: int, detailed: bool,
                      step_timing: dict[str, float] | None) -> list[str]:
        flops, duration = self._total_flops, self._duration
        rule = "-" * 30
        lines = [f"{rule} dsrun flops profiler {rule}", f"profile of step {profile_step}",
                 "(MACs: multiply-accumulates; FLOPs: floating-point operations = 2 x MACs of "
                 "matmul/conv/attention ops; FLOPS: FLOPs per second)", ""]
        rows = [("params", number_to_string(self.get_total_params())),
                ("fwd MACs", number_to_string(flops // 2, "MACs")),
                ("fwd FLOPs", number_to_string(flops)),
                ("fwd latency", number_to_string(duration, "s")),
                ("fwd FLOPS", number_to_string(flops / duration if duration else 0.0, "FLOPS"))]
        if step_timing:
            bwd_flops = (2.0 + self.recompute_fwd_factor) * flops
            fwd_t, bwd_t, step_t = (step_timing.get(k, 0.0) for k in ("forward", "backward", "step"))
            iteration = fwd_t + bwd_t + step_t
            rows += [("bwd FLOPs = (2 + recompute_fwd_factor) x fwd", number_to_string(bwd_flops)),
                     ("bwd latency (with gradient reduction)", number_to_string(bwd_t, "s")),
                     ("bwd FLOPS", number_to_string(bwd_flops / bwd_t if bwd_t else 0.0, "FLOPS")),
                     ("step latency", number_to_string(step_t, "s")),
                     ("iter latency (fwd + bwd + step)", number_to_string(iteration, "s")),
                     ("achieved FLOPS = (fwd + bwd FLOPs) / iter latency",
                      number_to_string((flops + bwd_flops) / iteration if iteration else 0.0, "FLOPS"))]
            if "batch_size" in step_timing and iteration:
                rows.append(("samples/second", f"{step_timing['batch_size'] / iteration:.2f}"))
        width = max(len(k) for k, _ in rows) + 2
        lines += [f"{k + ':':<{width}}{v}" for k, v in rows]
        lines += ["", f"{rule} top {top_modules} modules per depth {rule}"]
        max_depth = max((p.depth for p in self._profiles.values()), default=0)
        last = max_depth if module_depth < 0 else min(module_depth, max_depth)
        for depth in range(last + 1):
            level = [p for p in self._profiles.values() if p.depth == depth and id(p) in self._profile_ids()]
            if not level:
                continue
            lines.append(f"depth {depth}:")
            for label, key, fmt in (("params", lambda p: p.params, lambda v: number_to_string(v)),
                                    ("MACs", lambda p: p.macs, lambda v: number_to_string(v, "MACs")),
                                    ("fwd latency", lambda p: p.duration, lambda v: number_to_string(v, "s"))):
                top = sorted(level, key=key, reverse=True)[:top_modules]
                lines.append(f"    {label:<12}" + ", ".join(f"{p.name or p.type_name}: {fmt(key(p))}" for p in top))
        if detailed:
            lines += ["", f"{rule} per module {rule}",
                      "name (type): params, % params, MACs, % MACs, fwd latency, % latency, FLOPS"]
            lines += self._tree_lines("", last)
        return lines

    def _profile_ids(self) -> set[int]:
        return {id(p) for p in self._by_module.values()}

    def _tree_lines(self, name: str, last_depth: int) -> list[str]:
        prof = self._profiles[name]
        total_params = max(self._profiles[""].params, 1)
        total_flops, total_time = max(self._total_flops, 1), max(self._duration, 1e-12)
        flops_rate = prof.flops / prof.duration if prof.duration else 0.0
        lines = [f"{'  ' * prof.depth}{name.rsplit('.', 1)[-1] or 'model'} ({prof.type_name}): "
                 f"{number_to_string(prof.params)}, {100 * prof.params / total_params:.2f}%, "
                 f"{number_to_string(prof.macs, 'MACs')}, {100 * prof.flops / total_flops:.2f}%, "
                 f"{number_to_string(prof.duration, 's')}, {100 * prof.duration / total_time:.2f}%, "
                 f"{number_to_string(flops_rate, 'FLOPS')}"]
        if prof.depth < last_depth:
            for child in prof.children:
                lines += self._tree_lines(child, last_depth)
        return lines


def _make_inputs(model: torch.nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    """A random float tensor of `input_shape` on the model's device and dtype (DeepSpeed's rule)."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    return torch.randn(*input_shape, device=device, dtype=dtype)


def get_model_profile(model: torch.nn.Module, input_shape: tuple[int, ...] | None = None,
                      args: list | tuple = (), kwargs: dict | None = None, print_profile: bool = True,
                      detailed: bool = True, module_depth: int = -1, top_modules: int = 1,
                      warm_up: int = 1, as_string: bool = True, output_file: str | None = None,
                      ignore_modules: Iterable[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one forward of `model` and return (flops, macs, params).

    Args:
        model: the module; run in no_grad mode, its training flag unchanged.
        input_shape: shape of one random float input (e.g. (batch, features)),
            used when `args` and `kwargs` are empty.
        args, kwargs: the forward's arguments (e.g. token ids for a language model).
        print_profile: print the report (`print_model_profile`).
        detailed, module_depth, top_modules, output_file: as in print_model_profile.
        warm_up: unprofiled forward passes first (lazy initialisation, caches).
        as_string: return "1.23 G"-style strings instead of numbers.
        ignore_modules: module classes left out of the per-module table.
        mode: "forward" (model(*args, **kwargs)) or "generate"
            (model.generate(*args, **kwargs)).

    Returns:
        (FLOPs, MACs, parameters) of one forward.

    Raises:
        ValueError: neither input_shape nor args/kwargs are given, or an
            unknown mode.
    """
    kwargs = dict(kwargs or {})
    args = list(args)
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"input_shape must be a non-empty tuple of ints, got {input_shape!r}")
        args = [_make_inputs(model, input_shape), *args]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape or the forward's args/kwargs")
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    run = model.generate if mode == "generate" else model
    prof = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        prof.start_profile(ignore_list=ignore_modules)
        try:
            run(*args, **kwargs)
        finally:
            prof.stop_profile()
    if print_profile:
        prof.print_model_profile(module_depth=module_depth, top_modules=top_modules, detailed=detailed,
                                 output_file=output_file)
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    prof.end_profile()
    if as_string:
        return number_to_string(flops), number_to_string(macs, "MACs"), number_to_string(params)
    return flops, macs, params

"""The hooks a gradient strategy puts on the user's model: labelled, kept, removable.

[Note: strategy hooks]
A strategy registers every module, parameter and autograd hook it needs
through one `HookSet`, in one method of its own (`_register_hooks`), so
that `GradientStrategy.close()` -- and with it `engine.destroy()` -- removes
them all and leaves a module that runs as if dsrun had never touched it.
Each hook body runs inside `torch.profiler.record_function("dsrun::<what>")`
so that a profile shows where the hooks' time goes (the gathers of stage 3,
the reductions launched from backward). Entering a record_function costs
about 6 us even with no profiler running, once per parameter and
micro-step for the gradient hooks, so the label is only entered while a
profiler is recording (`torch.autograd._profiler_enabled()`): a labelled
hook then costs 0.2 us more than the bare function (CPU, torch 2.13,
timed by a loop of calls: 0.25 against 0.05 us; 5.9 us always entering).
Hooks registered per forward on that forward's output tensors (stage 3's
pre-backward hook) live and die with the autograd graph and are not kept.
Module hooks are hidden from torch.compile's tracer
(`torch.compiler.disable`): a compiled module runs them eagerly between its
graphs ([Note: compiling under ZeRO hooks] in dsrun/runtime/engine/compile.py);
that wrapper costs about 1 us per call in eager mode, once per hooked
module and forward.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle


def labelled(label: str, fn: Callable) -> Callable:
    """`fn` with its body inside `record_function(label)` while a profiler records.

    Raises ValueError for a label outside the "dsrun::" namespace (profiles
    are searched by that prefix)."""
    if not label.startswith("dsrun::"):
        raise ValueError(f"hook labels are 'dsrun::<what>', got {label!r}")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.autograd._profiler_enabled():  # see [Note: strategy hooks]: the label's cost
            return fn(*args, **kwargs)
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return run


def _untraced(fn: Callable) -> Callable:
    """`fn` run eagerly even inside a torch.compile'd frame: dynamo breaks the
    graph at the call and traces nothing `fn` calls (recursive)."""
    return torch.compiler.disable(fn, recursive=True)


class HookSet:
    """The handles of the hooks one strategy registered (see [Note: strategy hooks]).

    Each `on_*` method registers `fn` wrapped by `labelled(label, fn)` with
    torch's registration of that name and keeps the handle; `remove()`
    removes every one (again: nothing).
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        # Modules with forward (pre-)hooks, in registration order: their calls
        # break a torch.compile graph (engine.compile compiles each on its own).
        self.hooked_modules: list[torch.nn.Module] = []

    def __len__(self) -> int:
        return len(self._handles)

    def on_forward_pre(self, module: torch.nn.Module, label: str, fn: Callable) -> None:
        """fn(module, args) before `module`'s forward (Module.register_forward_pre_hook),
        never traced by torch.compile (see [Note: strategy hooks])."""
        self._handles.append(module.register_forward_pre_hook(_untraced(labelled(label, fn))))
        self._hook_module(module)

    def on_forward(self, module: torch.nn.Module, label: str, fn: Callable) -> None:
        """fn(module, args, output) after `module`'s forward (Module.register_forward_hook),
        never traced by torch.compile (see [Note: strategy hooks])."""
        self._handles.append(module.register_forward_hook(_untraced(labelled(label, fn))))
        self._hook_module(module)

    def _hook_module(self, module: torch.nn.Module) -> None:
        if all(m is not module for m in self.hooked_modules):
            self.hooked_modules.append(module)

    def on_grad_accumulated(self, param: torch.Tensor, label: str, fn: Callable) -> None:
        """fn(param) once autograd accumulated into `param.grad`
        (Tensor.register_post_accumulate_grad_hook)."""
        self._handles.append(param.register_post_accumulate_grad_hook(labelled(label, fn)))

    def remove(self) -> None:
        """Remove every hook registered here."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.hooked_modules.clear()

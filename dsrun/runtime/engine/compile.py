"""`engine.compile()`: torch.compile on the wrapped module, at every ZeRO stage.

DeepSpeed's `engine.compile(backend=..., compile_kwargs=..., schedule=None)`
calls `nn.Module.compile` on the wrapped module, which stores a compiled
`_call_impl` in the module itself: the module keeps its name, its
parameters and its state_dict keys (no `_orig_mod.` prefix), so
checkpoints, hooks and `engine.module` are unchanged. dsrun does the same
at stages 0-2, compiles per stage-3 unit (see the Note), and adds what
DeepSpeed leaves to the user: the backend name and the keyword arguments
are checked before anything is compiled, and `graph_breaks()` lists why
dynamo split the graph.

[Note: compiling under ZeRO hooks]
Stages 0-2 put hooks on parameters only (post-accumulate-grad hooks that
reduce gradients). They fire from the autograd engine after the compiled
backward has produced each gradient, outside any traced code, so
`engine.compile()` compiles the whole module (`nn.Module.compile`, as
DeepSpeed does) and nothing in dsrun breaks its graph.

Stage 3 puts forward pre- and post-hooks on every unit's modules (gather
before, release after, a backward pre-hook on the outputs; see
[Note: hooks] in dsrun/runtime/zero/stage3.py). Dynamo cannot trace them:
they issue all-gathers through process-group handles, resize untyped
storages and swap `param.data` between an empty tensor and a view of the
gathered buffer (shape (0,) <-> the full shape), which dynamo would refuse
or bake into a graph as constants. So `HookSet` registers every module
hook wrapped in `torch.compiler.disable(..., recursive=True)`
(dsrun/runtime/strategy/hooks.py): where traced code calls a hooked
module, dynamo breaks the graph, runs the hook eagerly and resumes in a
new graph. Compiling the root's `_call_impl` alone is not enough: the
first hook break inside a loop over blocks (`for block in self.h`) makes
dynamo give up on the whole frame ("graph break in loop", torch 2.13) and
the model runs eagerly. At stage 3 `engine.compile()` therefore compiles
each hooked module's own `forward` (every unit, the root included,
`HookSet.hooked_modules`), while the hooks stay in the eager `_call_impl`
around it: each unit is compiled as one region, as torchtitan compiles
per transformer block. The graph breaks left (listed by `graph_breaks()`)
are in the root's forward where it calls a unit (reason "Skip calling
`torch.compiler.disable()`d function", and "graph break in loop" when the
calls sit in a loop, so that the root's own layers -- embedding, final
norm, head -- run eagerly); every block's compiled forward runs as one
graph. Dynamo guards a graph on its parameters' shapes, so it is never
entered with a released (shape (0,)) parameter. Backward is unchanged:
the compiled backward of a unit runs after its pre-backward hook has
gathered it again, and the tensors it saved are the parameters (or views
of the storage) that the gather refills.
A model whose own code breaks the graph (data-dependent control flow,
`.item()`, print) breaks it the same way at every stage. `fullgraph=True`
turns any break into an error, so it is refused at stage 3.
"""
from __future__ import annotations

import collections
import dataclasses
import difflib
import inspect
import re
from typing import Any, Callable

import torch

from dsrun.runtime.observability.logging import logger

# The keyword arguments of torch.compile that may be passed as compile_kwargs
# (`backend` has its own argument; `model` is the module).
_COMPILE_KWARGS = tuple(p for p in inspect.signature(torch.compile).parameters if p not in ("model", "backend"))


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """What `engine.compile()` compiled the module with.

    Attributes:
        backend: the torch.compile backend (a name from
            `torch._dynamo.list_backends()`, or a callable).
        kwargs: the other torch.compile arguments (fullgraph, dynamic,
            mode, options, disable), as given.
    """

    backend: str | Callable
    kwargs: dict[str, Any]

    def same_as(self, other: "CompileSettings") -> bool:
        """Whether `other` asks for exactly this compilation."""
        return self.backend == other.backend and self.kwargs == other.kwargs


def known_backends() -> list[str]:
    """Names torch.compile accepts as `backend` here (every tag, debug ones included)."""
    import torch._dynamo  # imported on use: importing dynamo costs about a second

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def check_settings(backend: Any, compile_kwargs: dict | None, hooked_modules: int, schedule: Any = None,
                   compiled_autograd_enabled: bool = False) -> CompileSettings:
    """Validate `engine.compile()`'s arguments before anything is compiled.

    Args:
        backend: a backend name or a callable backend.
        compile_kwargs: torch.compile keyword arguments, or None.
        hooked_modules: modules the gradient strategy put forward hooks on
            (stage 3: every unit; see [Note: compiling under ZeRO hooks]).
        schedule: DeepCompile's pass schedule; DeepSpeed reads it only with
            `compile.deepcompile`, which dsrun refuses at initialize, so a
            schedule does nothing here and is named in a warning.
        compiled_autograd_enabled: DeepSpeed's switch for compiled autograd;
            True is refused (below).

    Returns:
        The settings, with a `backend` key in compile_kwargs dropped in
        favour of the argument (DeepSpeed does the same, with a warning).

    Raises:
        ValueError: an unknown backend name (the message lists the known
            ones and the closest), an unknown compile_kwargs key, or
            fullgraph=True while strategy hooks must break the graph.
        TypeError: backend is neither a string nor callable, or
            compile_kwargs is not a dict.
        NotImplementedError: compiled_autograd_enabled=True: compiled
            autograd would trace the gradient hooks that launch the
            reductions during backward, which issue collectives.
    """
    if compiled_autograd_enabled:
        raise NotImplementedError("engine.compile(compiled_autograd_enabled=True): dsrun does not run compiled "
                                  "autograd (it would trace the gradient-reduction hooks, which issue "
                                  "collectives); leave it False: the backward of each compiled graph is "
                                  "compiled anyway")
    if schedule is not None:
        logger.warning("engine.compile(schedule=...) is DeepCompile's pass schedule, which dsrun does not "
                       "implement; it is ignored and the module is compiled with plain torch.compile")
    if isinstance(backend, str):
        known = known_backends()
        if backend not in known:
            close = difflib.get_close_matches(backend, known, n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"engine.compile(): unknown torch.compile backend '{backend}'; {hint}"
                             f"known here: {', '.join(known)}")
    elif not callable(backend):
        raise TypeError(f"engine.compile(): backend must be a backend name such as 'inductor' or a callable, "
                        f"got {type(backend).__name__}")
    if not isinstance(compile_kwargs, (dict, type(None))):
        raise TypeError(f"engine.compile(): compile_kwargs must be a dict of torch.compile arguments, "
                        f"got {type(compile_kwargs).__name__}")
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        logger.warning("engine.compile(): compile_kwargs['backend']=%r is ignored; the backend argument (%r) "
                       "is used", kwargs.pop("backend"), backend)
    unknown = sorted(set(kwargs) - set(_COMPILE_KWARGS))
    if unknown:
        raise ValueError(f"engine.compile(): compile_kwargs {unknown} are not torch.compile arguments; "
                         f"valid: {', '.join(_COMPILE_KWARGS)}")
    if kwargs.get("fullgraph") and hooked_modules:
        raise ValueError(f"engine.compile(): fullgraph=True cannot hold with ZeRO stage 3: the gather/release "
                         f"hooks on {hooked_modules} of the model's modules run eagerly between graphs (see "
                         "[Note: compiling under ZeRO hooks] in dsrun/runtime/engine/compile.py); drop "
                         "fullgraph, or use stage 0-2")
    return CompileSettings(backend, kwargs)


class CompiledModel:
    """The wrapped module compiled in place (see [Note: compiling under ZeRO hooks]).

    Args:
        module: the engine's module.
        settings: checked by `check_settings`.
        regions: the modules whose forward hooks break graphs (a stage-3
            strategy's `HookSet.hooked_modules`); empty: compile `module`
            whole with `nn.Module.compile`, else compile each region's
            `forward` on its own and leave `module`'s `_call_impl` eager.

    Compilation itself happens at the first call of each compiled function.

    Attributes:
        settings: what it was compiled with. regions: the names of the
            modules compiled one by one ([] when compiled whole).
    """

    def __init__(self, module: torch.nn.Module, settings: CompileSettings,
                 regions: list[torch.nn.Module]) -> None:
        self.settings = settings
        self._module = module
        self._forwards: list[tuple[torch.nn.Module, Any]] = []  # (region, its own `forward` attribute or None)
        if not regions:
            module.compile(backend=settings.backend, **settings.kwargs)
            self.regions: list[str] = []
            return
        names = {id(m): n for n, m in module.named_modules()}
        self.regions = [names.get(id(m), type(m).__name__) or "<root>" for m in regions]
        for region in regions:
            self._forwards.append((region, region.__dict__.get("forward")))
            region.forward = torch.compile(region.forward, backend=settings.backend, **settings.kwargs)

    def undo(self) -> None:
        """Make the module eager again (before it is compiled with other settings)."""
        self._module._compiled_call_impl = None
        for region, own in self._forwards:
            if own is None:
                del region.forward
            else:
                region.forward = own
        self._forwards.clear()


def graph_breaks() -> dict[str, int]:
    """Why dynamo split a graph, or gave up on a frame, in this process so
    far: one line per reason -> count. Empty when every compiled frame was
    one graph; `torch._dynamo.reset()` clears it.

    Read from dynamo's counters: "graph_break" (the graph was split and
    tracing resumed after the break) and "unimplemented" (the frame, or the
    rest of it, ran eagerly: e.g. a break inside a loop). Each reason is
    shortened to its first line, the function it names (addresses dropped)
    and the frame dynamo skipped, if any.
    """
    from torch._dynamo.utils import counters

    found: collections.Counter = collections.Counter()
    for kind in ("graph_break", "unimplemented"):
        for reason, count in counters[kind].items():
            found[f"{kind}: {_short_reason(reason)}"] += count
    return dict(found)


def _short_reason(reason: str) -> str:
    """First line of a dynamo break message, plus the names in its context lines."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    parts = [lines[0]] if lines else [reason]
    for line in lines[1:]:
        if line.startswith("Developer debug context:"):
            parts.append(re.sub(r" at 0x[0-9a-f]+", "", line.split(":", 1)[1].strip()))
        elif line == "graph break in loop":
            parts.append(line)
    return "; ".join(dict.fromkeys(parts))

"""What stage 3 needs to know about a module beyond its own parameters:
leaf modules (DeepSpeed's `set_z3_leaf_modules`), parameters it uses
but does not own (`register_external_parameter`), and the children that
are a module's layers.

A leaf module is gathered and released as a whole: stage 3 never makes a
gather unit of anything inside it. Use it for blocks whose forward runs a
data-dependent subset of their children, such as a Mixture-of-Experts layer
whose experts sit in an nn.ModuleList: with one unit per expert, ranks
that route to different experts would issue different all-gathers and wait
for each other for ever; with the block as one unit, every rank gathers
the same parameters. Mark the modules before `initialize()`. (dsrun's own
`moe.layer.MoE` runs every local expert on every forward and needs no mark:
its experts are units of their own, partitioned over their expert-data-
parallel group; marking it raises, see zero/experts.py.)

An external parameter is one that a module's forward reads from another
module (e.g. a tied embedding read by the output layer). Registered with
`register_external_parameter(module, param)`, it is placed in the gather
unit enclosing every module that uses it, so it is gathered whenever any
of them runs (see stage3._assign).
"""
from __future__ import annotations

import torch

LEAF_ATTR = "_z3_leaf"
EXTERNAL_ATTR = "_dsrun_external_params"
LAYERS_ATTR = "_z3_layers"


def _matches(module: torch.nn.Module, classes) -> bool:
    return any(isinstance(module, c) if isinstance(c, type) else type(module).__name__ == c for c in classes)


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list) -> list[torch.nn.Module]:
    """Mark every submodule of `model` whose class is in `leaf_module_classes`
    (classes or class names) as a ZeRO-3 leaf; return the marked modules.

    Raises:
        ValueError: no submodule matched (a misspelt class would otherwise
            leave the deadlock this prevents in place).
    """
    marked = [m for m in model.modules() if _matches(m, leaf_module_classes)]
    if not marked:
        names = [c.__name__ if isinstance(c, type) else str(c) for c in leaf_module_classes]
        raise ValueError(f"set_z3_leaf_modules: no module of class {', '.join(names)} in "
                         f"{type(model).__name__}")
    for m in marked:
        setattr(m, LEAF_ATTR, True)
    return marked


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list) -> list[torch.nn.Module]:
    """Remove the mark from the matching submodules; return them."""
    found = [m for m in model.modules() if _matches(m, leaf_module_classes)]
    for m in found:
        m.__dict__.pop(LEAF_ATTR, None)
    return found


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """True when `model` is marked as a ZeRO-3 leaf."""
    return bool(getattr(model, LEAF_ATTR, False))


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The marked submodules of `model`."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that `module`'s forward uses `parameter`, which another module
    owns (DeepSpeed's zero.register_external_parameter). Call it before
    `initialize()` (e.g. in the module's constructor).

    Raises:
        TypeError: `parameter` is not a torch.nn.Parameter.
    """
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter: expected a torch.nn.Parameter, got "
                        f"{type(parameter).__name__}")
    found = module.__dict__.setdefault(EXTERNAL_ATTR, [])
    if not any(p is parameter for p in found):
        found.append(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo register_external_parameter (no-op when it was not registered)."""
    found = module.__dict__.get(EXTERNAL_ATTR, [])
    found[:] = [p for p in found if p is not parameter]


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered as external to `module`."""
    return list(module.__dict__.get(EXTERNAL_ATTR, ()))


def z3_layer_names(module: torch.nn.Module) -> list[str]:
    """Names of the children of `module` that are its layers, run one after
    another (empty: none declared). Stage 3 makes each a gather unit, as it
    does each element of an nn.ModuleList. A module that registers its layers
    by index as direct children instead of holding a list (dsrun's
    PipelineModule, whose parameter names must stay DeepSpeed's "3.weight")
    declares them in a `_z3_layers` list of child names; other children
    (its tied modules, read through forward functions outside their own
    forward) stay in the module's own unit."""
    return list(getattr(module, LAYERS_ATTR, ()))

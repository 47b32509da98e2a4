"""Putting random-LTD into a model and taking it out of its state dict (DeepSpeed's helper names).

    model = MyGPT(...)
    model = convert_to_random_ltd(model, Block)          # before or after dsrun.initialize
    engine, *_ = dsrun.initialize(model=model, config=ds_config)   # a data_routing.random_ltd config
    ...
    torch.save(save_without_random_ltd(engine), "plain.pt")        # loads into MyGPT(...)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, runtime_checkable

import torch

from dsrun.runtime.config import DsConfig
from dsrun.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from dsrun.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

_WRAPPED = ".random_ltd_layer"  # what the wrapper adds to its layer's state-dict keys


@runtime_checkable
class RandomLTDHost(Protocol):
    """An engine: holds the model as `.module` and binds its dropping layers
    to its scheduler in `random_ltd_initialize()`."""

    module: torch.nn.Module

    def random_ltd_initialize(self) -> None: ...


def _model_of(model: torch.nn.Module | RandomLTDHost) -> torch.nn.Module:
    return model.module if isinstance(model, RandomLTDHost) else model


def convert_to_random_ltd(model: torch.nn.Module | RandomLTDHost, layer_class: type) -> torch.nn.Module:
    """Wrap every `layer_class` instance of the model in a `RandomLayerTokenDrop`.

    All instances are wrapped, in module order (layer 0 is the first found);
    the engine makes those that `random_ltd_layer_id` lists drop tokens and
    leaves the others running on every token. Layers inside a wrapped layer
    are not wrapped again. Called on an engine (DeepSpeed's usage, after
    `initialize`), it converts `engine.module` and binds the layers at once
    (`engine.random_ltd_initialize()`); called on a plain model, the engine
    binds them when it is built. Parameters are not copied, so an optimizer
    built before keeps training them.

    Args:
        model: a torch module, or an engine.
        layer_class: the class of the transformer layers (e.g. a GPT block).

    Returns:
        `model`, converted in place.

    Raises:
        ValueError: the model holds no `layer_class` module below its root.
    """
    root = _model_of(model)
    wrapped = _wrap_children(root, layer_class)
    if wrapped == 0:
        raise ValueError(f"convert_to_random_ltd: {type(root).__name__} holds no {layer_class.__name__} module "
                         "below its root; pass the class of its transformer layers")
    if isinstance(model, RandomLTDHost):
        model.random_ltd_initialize()
    return model


def _wrap_children(parent: torch.nn.Module, layer_class: type) -> int:
    count = 0
    for name, child in list(parent.named_children()):
        if isinstance(child, layer_class):
            setattr(parent, name, RandomLayerTokenDrop(child))
            count += 1
        elif not isinstance(child, RandomLayerTokenDrop):
            count += _wrap_children(child, layer_class)
    return count


def bind_random_ltd_layers(module: torch.nn.Module, scheduler: RandomLTDScheduler) -> None:
    """Make the listed wrapped layers of `module` drop tokens on `scheduler`'s schedule.

    Raises:
        ValueError: the number of wrapped layers is not the config's
            total_layer_num (convert_to_random_ltd was given another class,
            or the config another model).
    """
    layers = [m for m in module.modules() if isinstance(m, RandomLayerTokenDrop)]
    settings = scheduler.random_ltd
    if len(layers) != settings.total_layer_num:
        raise ValueError(f"random_ltd.total_layer_num is {settings.total_layer_num} but the model has {len(layers)} "
                         "layers converted by convert_to_random_ltd; set total_layer_num to the number of layers "
                         "of the class you converted")
    for position, layer_id in enumerate(sorted(settings.random_ltd_layer_id)):
        layers[layer_id].init_config(scheduler, position)


def random_ltd_scheduler(config: DsConfig) -> RandomLTDScheduler | None:
    """The scheduler for a config's random-LTD section, or None when it is off
    (data_efficiency, data_routing and random_ltd must all be enabled)."""
    efficiency = config.data_efficiency
    routing = efficiency.data_routing
    if not (efficiency.enabled and routing.enabled and routing.random_ltd.enabled):
        return None
    return RandomLTDScheduler(routing.random_ltd, config.train_batch_size)


def remove_random_ltd_state_dict(state_dict: dict[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    """The state dict with the wrappers' ".random_ltd_layer" removed from every
    key: what the model without random-LTD has (tensors are not copied)."""
    return OrderedDict((key.replace(_WRAPPED, ""), value) for key, value in state_dict.items())


def save_without_random_ltd(model: torch.nn.Module | RandomLTDHost) -> OrderedDict[str, torch.Tensor]:
    """The state dict of a converted model (or of an engine's model) as the
    plain model's: loads with `load_state_dict(..., strict=True)` into the
    model before `convert_to_random_ltd`."""
    return remove_random_ltd_state_dict(_model_of(model).state_dict())

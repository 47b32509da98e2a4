"""The engine and a rank's start: `initialize` (entry.py), the `Engine`
(engine.py) with DeepSpeed's query surface (compat.py), the pipeline
engine (pipeline_engine.py, an `Engine` running schedules), the `TrainState`
counters and `TrainingParts` handed to the checkpointer and telemetry
(train_state.py), what a step reports (telemetry.py), the data loader.

This package is also DeepSpeed's `deepspeed.runtime.engine`: its names
resolve lazily to engine.py, so that importing train_state.py (as the
checkpointer does) does not load the engine, which imports the checkpointer.
"""
import importlib

_ENGINE_NAMES = ("DeepSpeedEngine", "Engine")


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        return getattr(importlib.import_module("dsrun.runtime.engine.engine"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

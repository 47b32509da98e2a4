"""Checkpoints: atomic, parallel, resharding on load, no pickle.

checkpointer.py: `save(engine, ...)` / `load(engine, ...)`, what
engine.save_checkpoint / load_checkpoint call; store.py: the format;
pieces.py: what a rank holds. (This package imports only the format here, so
that the ZeRO strategies can import pieces.py without a cycle.)
"""
from dsrun.runtime.checkpoint.store import CheckpointError, Index, resolve_tag

__all__ = ["CheckpointError", "Index", "resolve_tag"]

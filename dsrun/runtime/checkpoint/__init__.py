"""Checkpoints: atomic, parallel, resharding on load, no pickle.

checkpointer.py: the engine's `Checkpointer` (engine.save_checkpoint /
load_checkpoint / save_16bit_model call it) over rendezvous.py, save.py,
load.py and export.py; store.py: the format; pieces.py: what a rank
holds. (This package imports only the format here, so that the ZeRO
strategies can import pieces.py without a cycle.)
"""
from dsrun.numpy_warning import quiet_missing_numpy

# `dsrun-ckpt` (cli.py) imports torch first here, through store.py: see
# [Note: torch's NumPy warning] in dsrun/numpy_warning.py. In a training
# process torch is imported already and this changes nothing.
with quiet_missing_numpy():
    from dsrun.runtime.checkpoint.store import CheckpointError, Index, resolve_tag

__all__ = ["CheckpointError", "Index", "resolve_tag"]

"""The `deepspeed` import name as an alias of dsrun (used by the optional
`deepspeed` alias distribution in extras/deepspeed-alias/).

[Note: the deepspeed alias]
Hugging Face's Trainer and Accelerate `import deepspeed` and check that a
distribution named "deepspeed" is installed; DeepSpeed scripts write
`from deepspeed.X import Y`. `install()` makes `deepspeed` and every
`deepspeed.X` the very module objects `dsrun` and `dsrun.X` (not copies:
one comms logger, one set of ZeRO records), through a finder placed first
on sys.meta_path; a DeepSpeed module dsrun lacks fails as `dsrun.X` does
(dsrun/compat/missing.py).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

ALIAS = "deepspeed"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        # The import system returns whatever sys.modules holds for the name after this.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves `deepspeed.X` to the module `dsrun.X`."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(ALIAS + "."):
            return None
        real = "dsrun" + fullname[len(ALIAS):]
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


def install() -> None:
    """Make `import deepspeed` (and `deepspeed.X`) give dsrun's modules (idempotent)."""
    import dsrun
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
    sys.modules[ALIAS] = dsrun

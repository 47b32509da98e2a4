"""Packaging entry kept for `DSRUN_BUILD_OPS=1 pip install --no-build-isolation .`
(ahead-of-time op builds). All metadata lives in pyproject.toml.

Every build copies csrc/ into the package (dsrun/ops/csrc) so an installed
dsrun can build its ops just in time. With DSRUN_BUILD_OPS=1 it also builds
every op that can be built here into dsrun/ops/_prebuilt/<op>-<source key>/,
which dsrun loads before trying a JIT build (see dsrun/ops/builder.py).
Building needs torch, hence --no-build-isolation.
"""
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load_builder():
    # Load builder.py on its own: importing the dsrun package would import the whole runtime.
    spec = importlib.util.spec_from_file_location("_dsrun_ops_builder", ROOT / "dsrun" / "ops" / "builder.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildPyWithOps(build_py):
    def run(self):
        super().run()
        ops_dir = Path(self.build_lib) / "dsrun" / "ops"
        shutil.copytree(ROOT / "csrc", ops_dir / "csrc", dirs_exist_ok=True)
        if os.environ.get("DSRUN_BUILD_OPS", "0") != "1":
            return
        try:
            builder = _load_builder()
        except ImportError as e:
            raise SystemExit(f"DSRUN_BUILD_OPS=1 needs torch in the build environment ({e}); "
                             "run: DSRUN_BUILD_OPS=1 pip install --no-build-isolation .") from None
        for name, spec in builder.OPS.items():
            try:
                builder.check_compatible(spec)
            except builder.OpBuildError as e:
                print(f"dsrun: not prebuilding {name}: {e}")
                continue
            out = ops_dir / "_prebuilt" / f"{name}-{builder.source_key(spec)}"
            lib = builder.build(spec, build_dir=out)  # raises OpBuildError: a requested build failing is an error
            for leftover in out.iterdir():  # keep the library and its completion marker only
                if leftover != lib and leftover.name != "BUILD_OK":
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            print(f"dsrun: prebuilt {name} -> {lib}")


setup(cmdclass={"build_py": BuildPyWithOps})

"""The `deepspeed` alias distribution of dsrun (see README.md next to this file).

It installs a package named `deepspeed` whose import gives dsrun, and
distribution metadata named "deepspeed", which is what Hugging Face
Transformers and Accelerate look for. Building it fails when a real
DeepSpeed is installed in the target environment: pip would otherwise
uninstall DeepSpeed to make room for the alias.
"""
import os
import subprocess
import sys

from setuptools import setup

ALIAS_MARK = "dsrun alias"  # in the Summary of this distribution's metadata

_PROBE = """
import importlib.metadata as md
try:
    d = md.distribution("deepspeed")
except md.PackageNotFoundError:
    print("none")
else:
    print("alias" if "dsrun alias" in (d.metadata.get("Summary") or "") else "real " + d.version)
"""


def _installed_deepspeed() -> str:
    """What "deepspeed" the interpreter running this build sees in its own
    environment (pip's isolated build path removed from the environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True)
    return out.stdout.strip() or "none"


found = _installed_deepspeed()
if found.startswith("real"):
    sys.exit(f"error: DeepSpeed {found.split()[1]} is installed in this environment; the dsrun alias "
             "distribution also provides the name 'deepspeed' and pip would uninstall DeepSpeed to install "
             "it. Use a separate environment for dsrun, or `pip uninstall deepspeed` first.")

setup(
    name="deepspeed",
    version="0.16.5+dsrun.0.1.0",
    description=f"{ALIAS_MARK}: the deepspeed import name and metadata for dsrun (not DeepSpeed)",
    packages=["deepspeed"],
    install_requires=["dsrun"],
    python_requires=">=3.10",
)

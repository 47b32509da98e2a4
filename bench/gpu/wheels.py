"""dsrun's runtime packages as wheels, for a GPU machine that has torch but no network.

    python bench/gpu/wheels.py download gpu-wheels [--python-version 3.12]   # here (make gpu-wheels)
    python bench/gpu/wheels.py install gpu-wheels build/gpu-site              # there (gpu_check.py --wheels)

`download` fetches pyproject.toml's run-time dependencies except torch (the
GPU machine has its own CUDA build) and everything they depend on, as binary
wheels only, for CPython `--python-version` on manylinux x86_64 up to glibc
2.28 (torch's own Linux wheels need 2.28, so a machine that runs torch has
it), and fails when the folder comes to more than 64 MiB (what may be
copied to the GPU machine beside the work tree; the set is about 14 MiB).

`install` runs `pip install --no-index --find-links DIR --target SITE` of
the same requirements and returns the seconds it took; `activate` puts SITE
(and the repository root, so that this checkout's dsrun is the one imported
without installing it) first on sys.path and PYTHONPATH, and SITE/bin on
PATH (the `ninja` that torch.utils.cpp_extension runs).

[Note: --target, not a venv or --user]
A separate folder needs neither the python3-venv package (a venv with
--system-site-packages would) nor a pip allowed to write the user site (a
Debian or Ubuntu system Python is "externally managed", PEP 668, and
refuses `--user`; pip skips that check for --target), leaves the system's
site-packages as they were, and keeps the system's torch visible. pip
ignores what is already installed when given --target, so every
requirement comes from DIR, whatever versions the machine has.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MIB = 64
# manylinux tags at or below glibc 2.28: pip does not widen a --platform to the older tags itself
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64"]


def requirements() -> list[str]:
    """pyproject.toml's [project] dependencies other than torch, e.g. 'pydantic>=2.6'."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() != "torch"]


def folder_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.whl")) / 2**20


def download(folder: Path, python_version: str) -> None:
    """Fetch the wheels into `folder`. Raises SystemExit when pip fails or the
    folder is over MAX_MIB."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(folder), "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           *[a for p in PLATFORMS for a in ("--platform", p)], *requirements()]
    print(shlex.join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit("pip download failed (see above)")
    mib = folder_mib(folder)
    print(f"{folder}: {len(list(folder.glob('*.whl')))} wheels, {mib:.1f} MiB", flush=True)
    if mib > MAX_MIB:
        raise SystemExit(f"{folder} holds {mib:.1f} MiB of wheels, over the {MAX_MIB} MiB that can be copied "
                         "beside the work tree: remove old versions (rm -r the folder and download again)")


def install(folder: Path, site: Path) -> float:
    """pip-install the requirements from `folder` only into `site`; seconds taken.
    Raises SystemExit (pip's message above it) when pip fails, e.g. a wheel
    for another Python version."""
    if not any(folder.glob("*.whl")):
        raise SystemExit(f"no wheels in {folder}: run `make gpu-wheels` on a machine with a network and copy "
                         "the folder beside the work tree")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
           "--find-links", str(folder), "--target", str(site), "--upgrade", *requirements()]
    print(shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"installing the wheels of {folder} with {sys.executable} failed (see above)")
    return time.perf_counter() - t0


def activate(site: Path | None) -> None:
    """This process and its children import from `site` (when given), then
    this checkout, before anything installed; `site`/bin is searched first."""
    first = [str(site), str(ROOT)] if site else [str(ROOT)]
    sys.path[:0] = first
    os.environ["PYTHONPATH"] = os.pathsep.join(first + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if site:
        os.environ["PATH"] = os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download")
    d.add_argument("folder", type=Path)
    d.add_argument("--python-version", default="3.12", help="the GPU machine's Python (major.minor)")
    i = sub.add_parser("install")
    i.add_argument("folder", type=Path)
    i.add_argument("site", type=Path)
    args = p.parse_args()
    if args.cmd == "download":
        download(args.folder, args.python_version)
    else:
        print(f"installed in {install(args.folder, args.site):.1f} s", flush=True)


if __name__ == "__main__":
    main()

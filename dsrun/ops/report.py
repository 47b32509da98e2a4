"""`dsrun-report`: what each native op can do on this machine.

Prints, per op: compatible (can be built here), built, loaded, the reason if
not, the instruction set in use; and the torch / CUDA / compiler versions.
With --strict (CI: .ci/run) it exits 1 when a CPU op that this machine can
build did not load, i.e. the caller would take its PyTorch fallback.
"""
from __future__ import annotations

import platform
import shutil
import subprocess
import sys

import click
from rich.console import Console
from rich.table import Table

from dsrun.numpy_warning import quiet_missing_numpy

with quiet_missing_numpy():  # see [Note: torch's NumPy warning] in dsrun/numpy_warning.py
    import torch

from dsrun.ops import builder


def _nvcc_version() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "not found"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    return out.splitlines()[-1] if out else "unknown"


def _isa(name: str, loaded: bool) -> str:
    if not loaded:
        return "-"
    if name == "cpu_adam":
        from dsrun.ops.adam import selected_isa
        return selected_isa() or "-"
    if name == "quantizer":
        from dsrun.ops.quantizer import selected_isa as quantizer_isa
        return quantizer_isa() or "-"
    if name == "shm_comm":
        return "avx2/baseline (ifunc)"
    if name in ("cuda_adam", "quantizer_cuda"):
        return "cuda"
    if name == "aio":  # the engine the kernel lets AioHandle use (io_uring may be refused, e.g. by seccomp)
        from dsrun.ops.aio import PAGE, AioHandle
        with AioHandle(block_size=PAGE, queue_depth=1) as handle:
            return f"engine {handle.engine}"
    return "n/a"


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]no[/]"


def cpu_fallbacks(statuses: dict[str, builder.OpStatus]) -> list[str]:
    """'op: reason' for each CPU op (no CUDA source) that is compatible with this machine but
    not loaded; `statuses` maps op names to what NativeOp.status() returned after loading."""
    return [f"{name}: {st.reason or 'not loaded'}" for name, st in statuses.items()
            if not builder.OPS[name].requires_cuda and st.compatible and not st.loaded]


@click.command()
@click.option("--build/--no-build", default=True, show_default=True,
              help="Build missing ops (cached per user) before reporting; --no-build only inspects.")
@click.option("--strict", is_flag=True,
              help="Exit 1 when a CPU op this machine can build does not load (it would fall back to PyTorch).")
def main(build: bool, strict: bool) -> None:
    """Report dsrun's native ops: compatible, built, loaded, why not, instruction set, versions."""
    if strict and not build:
        raise click.UsageError("--strict loads every op, so it cannot be combined with --no-build")
    console = Console()
    table = Table(title="dsrun native ops")
    for col in ("op", "compatible", "built", "loaded", "isa", "reason / library"):
        table.add_column(col, overflow="fold")
    statuses = {}
    for name in builder.OPS:
        st = statuses[name] = builder.get_op(name).status(build_missing=build)
        detail = st.reason if st.reason else st.path or ""
        table.add_row(name, _yes(st.compatible), _yes(st.built), _yes(st.loaded), _isa(name, st.loaded), detail)
    console.print(table)
    cpu_flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    simd = [f for f in ("avx512f", "avx2", "fma", "f16c") if f" {f}" in cpu_flags]
    console.print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'}, "
                  f"GPU {'available' if torch.cuda.is_available() else 'none'})")
    console.print(f"C++ compiler ({builder.compiler()}): {builder.compiler_version()}")
    console.print(f"nvcc: {_nvcc_version()}")
    console.print(f"CPU: {platform.machine()}, SIMD: {', '.join(simd) or 'none detected'}; "
                  f"build cache: {builder.cache_root()}")
    fallbacks = cpu_fallbacks(statuses) if strict else []
    if fallbacks:
        print("dsrun-report --strict: CPU ops this machine can build fell back to PyTorch:\n  "
              + "\n  ".join(fallbacks), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

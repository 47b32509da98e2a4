"""What this machine offers ranks: visible GPUs and CPU cores, the default process count.

A leaf of the launcher: the command line (cli.py) and the launch
(multinode.py) both ask it, and it imports neither.
"""
from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from dsrun.numpy_warning import quiet_missing_numpy


def visible_gpu_count() -> int:
    """GPUs a rank here could use, without importing torch: CUDA_VISIBLE_DEVICES if set, else the
    NVIDIA driver's list (/proc/driver/nvidia/gpus); 0 without a driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def warn_if_oversubscribed(num_procs: int, console: Console) -> None:
    """Warn when a machine gets more ranks than it has GPUs, or (without GPUs) CPU cores."""
    cores, gpus = len(os.sched_getaffinity(0)), visible_gpu_count()
    if gpus and num_procs > gpus:
        console.print(f"dsrun: warning: {num_procs} ranks but {gpus} visible GPU(s) on this machine: "
                      f"ranks with LOCAL_RANK >= {gpus} have no GPU of their own")
    elif not gpus and num_procs > cores:
        console.print(f"dsrun: warning: {num_procs} ranks on a machine with {cores} CPU core(s) and no GPU: "
                      "each rank is a Python process with its own copy of the model, so they will time-share "
                      f"the cores and may run out of memory; --num_procs {cores} or fewer is faster")


def default_num_procs(console: Console) -> int:
    """One process per visible CUDA GPU, else 1 with a notice on `console` (imports torch: about a second)."""
    with quiet_missing_numpy():  # see [Note: torch's NumPy warning] in dsrun/numpy_warning.py
        import torch  # deferred: importing torch costs ~1 s, and only this default needs it

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        console.print("dsrun: no CUDA GPU visible; starting 1 process (pass --num_procs N to start N)")
        return 1
    return count

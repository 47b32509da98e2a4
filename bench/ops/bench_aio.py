"""Async file I/O throughput: dsrun's aio engines vs fio, same directory, one run.

    .venv/bin/python bench/ops/bench_aio.py [--dir /tmp] [--size-mib 512] [--block-size 1048576]
                                            [--queue-depth 8] [--repeats 3]

Every case moves --size-mib MiB sequentially with O_DIRECT in --block-size
requests, --queue-depth in flight, one thread: fio with its io_uring and
libaio engines (the baseline is fio io_uring), dsrun with each engine, from a
page-aligned buffer and (reads) into an unaligned one (bounce buffers).
Rounds are interleaved. Writes are not fsync'd by either (O_DIRECT). The disk
here is a host-cached virtio disk, not NVMe: absolute numbers swing between
runs; compare the ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import table  # noqa: E402

from dsrun.ops import aio  # noqa: E402


def fio(path: Path, rw: str, engine: str, size_mib: int, bs: int, qd: int) -> float:
    """GiB/s fio reports for one sequential pass."""
    out = subprocess.run(["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
                          f"--iodepth={qd}", f"--ioengine={engine}", "--direct=1", f"--size={size_mib}m",
                          "--numjobs=1", "--output-format=json"], capture_output=True, text=True, check=True)
    job = json.loads(out.stdout)["jobs"][0]["read" if rw == "read" else "write"]
    return job["bw_bytes"] / 2**30


def dsrun_io(handle: aio.AioHandle, tensor: torch.Tensor, path: Path, write: bool) -> float:
    t0 = time.perf_counter()
    (handle.pwrite if write else handle.pread)(tensor, path)
    return tensor.numel() / 2**30 / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if shutil.which("fio") is None:
        sys.exit("fio not found: apt-get install fio")
    work = Path(args.dir) / f"dsrun_bench_aio_{os.getpid()}"
    work.mkdir(parents=True)
    nbytes = args.size_mib << 20
    aligned = aio.new_aligned_tensor(nbytes)
    aligned.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    unaligned = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    handles = {e: aio.AioHandle(args.block_size, args.queue_depth, 1, engine=e) for e in aio.ENGINES}
    writes: dict[str, list[float]] = {}
    reads: dict[str, list[float]] = {}
    f = work / "data.bin"
    try:
        for _ in range(args.repeats):
            for engine in aio.ENGINES:
                writes.setdefault(f"fio {engine}", []).append(
                    fio(f, "write", engine, args.size_mib, args.block_size, args.queue_depth))
                reads.setdefault(f"fio {engine}", []).append(
                    fio(f, "read", engine, args.size_mib, args.block_size, args.queue_depth))
            for engine, h in handles.items():
                writes.setdefault(f"dsrun {engine}", []).append(dsrun_io(h, aligned, f, True))
                reads.setdefault(f"dsrun {engine}", []).append(dsrun_io(h, aligned, f, False))
                reads.setdefault(f"dsrun {engine} unaligned", []).append(dsrun_io(h, unaligned, f, False))
        assert torch.equal(unaligned, aligned), "data read back differs"
    finally:
        shutil.rmtree(work)
    what = f"{args.size_mib} MiB, bs {args.block_size}, qd {args.queue_depth}, O_DIRECT, in {args.dir}"
    print(table(f"Sequential write, {what}", list(writes.items()), "fio io_uring", "GiB/s", higher_is_better=True))
    print()
    print(table(f"Sequential read, {what}", list(reads.items()), "fio io_uring", "GiB/s", higher_is_better=True))


if __name__ == "__main__":
    main()

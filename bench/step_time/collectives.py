"""Which gloo collective to use for ZeRO's reduce-scatter and all-gather.

    .venv/bin/python bench/step_time/collectives.py [--mib 64] [--repeats 5]

2 ranks on one machine. Times all_reduce, reduce_scatter_tensor and
all_gather_into_tensor of the same fp32 buffer, and dsrun's region
collectives (zero/collectives.py), which on gloo are built from
all_reduce. Prints median and min-max of each, and the ratio to all_reduce.
See [Note: choosing the collective per backend].
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _rank(rank, port, numel, repeats, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from dsrun.runtime.zero.collectives import all_gather_region, reduce_region
    from dsrun.runtime.zero.groups import RankGroup, ZeroGroups
    from dsrun.runtime.zero.partition import FlatLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    full = torch.randn(numel)
    half = torch.empty(numel // 2)
    layout = FlatLayout.build([("x", (numel,))], 2)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(half, full),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, half),
        "dsrun reduce_region": lambda: reduce_region(layout, layout.buckets, full, half, ZeroGroups.sharded()),
        "dsrun all_gather_region": lambda: all_gather_region(layout, layout.buckets, full, RankGroup.of()),
    }
    res = {}
    for name, fn in ops.items():
        ts = []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        res[name] = ts[1:]
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    numel = args.mib * 2**20 // 4 // 2 * 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, numel, args.repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    res = out.get(timeout=600)
    for p in procs:
        p.join()
    base = statistics.median(res["all_reduce"])
    print(f"gloo, 2 ranks, {args.mib} MiB fp32, {args.repeats} repeats\n")
    print("| op | median ms | min-max ms | vs all_reduce |\n|---|---|---|---|")
    for name, ts in res.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()

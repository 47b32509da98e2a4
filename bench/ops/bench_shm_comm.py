"""Shared-memory collectives vs gloo, 2 ranks on this node, one run.

    .venv/bin/python bench/ops/bench_shm_comm.py [--sizes-mib 16 192] [--ranks 2] [--repeats 7]

Per size, fp32, each rank with one torch thread: gloo all_reduce (the
baseline), gloo reduce_scatter_tensor, all_gather_into_tensor and
all_to_all_single (the MoE layer's and Ulysses' exchange), and dsrun's shm
all_reduce, reduce_scatter, all_gather, broadcast and all_to_all (equal
blocks, and "uneven": the same bytes cut into blocks of 1..world rows of
32 floats per rank pair, as Ulysses cuts heads the ranks do not divide).
The size is the full tensor (all_reduce input, reduce_scatter input,
all_gather output, all_to_all input and output).
Times are rank 0's, each call preceded by a barrier; rounds interleave the
cases. With --deepspeed DIR (a directory holding the deepspeed package),
DeepSpeed's CPU shared-memory all_reduce (deepspeed.comm.inference_all_reduce
with DS_ACCELERATOR=cpu; its op is JIT-built on first use) runs in the same
rounds; REFERENCE.md measured it at 63-67 ms at 192 MiB on this kind of machine.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def rank_main(rank: int, world: int, port: int, sizes: list[int], repeats: int, name: str, slot_mib: int,
              deepspeed_dir: str | None, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from dsrun.ops import shm_comm
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = shm_comm.ShmGroup(name, rank, world, barrier=dist.barrier, slot_bytes=slot_mib << 20)
    ds_all_reduce = None
    if deepspeed_dir:
        # DeepSpeed's shm op needs LOCAL_SIZE (it crashes without it, REFERENCE.md §6).
        os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
        sys.path.insert(0, deepspeed_dir)
        import deepspeed
        import deepspeed.comm
        deepspeed.init_distributed("gloo")
        ds_all_reduce = deepspeed.comm.inference_all_reduce
    results = {}
    for mib in sizes:
        n = (mib << 20) // 4 // world * world
        full = torch.randn(n)
        part = torch.randn(n // world)
        exchanged = torch.empty(n)
        # Uneven blocks: rank i sends rank j a share (1 + (i + j) % world) of its rows.
        rows = n // 32
        shares = [[1 + (i + j) % world for j in range(world)] for i in range(world)]
        send_rows = [rows * shares[rank][j] // sum(shares[rank]) for j in range(world)]
        send_rows[-1] += rows - sum(send_rows)
        every = [[rows * shares[i][j] // sum(shares[i]) for j in range(world)] for i in range(world)]
        for i in range(world):
            every[i][-1] += rows - sum(every[i])
        recv_rows = [every[i][rank] for i in range(world)]
        full_rows = torch.randn(rows, 32)
        exchanged_rows = torch.empty(sum(recv_rows), 32)
        cases = {
            "gloo all_reduce": lambda: dist.all_reduce(full),
            "gloo reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
            "gloo all_gather": lambda: dist.all_gather_into_tensor(full, part),
            "gloo all_to_all": lambda: dist.all_to_all_single(exchanged, full),
            "shm all_reduce": lambda: group.all_reduce(full),
            "shm reduce_scatter": lambda: group.reduce_scatter(part, full),
            "shm all_gather": lambda: group.all_gather(full, part),
            "shm broadcast": lambda: group.broadcast(full, 0),
            "shm all_to_all": lambda: group.all_to_all(exchanged, full),
            "shm all_to_all uneven": lambda: group.all_to_all(exchanged_rows, full_rows, recv_rows, send_rows),
        }
        if ds_all_reduce is not None:
            cases["deepspeed shm all_reduce"] = lambda: ds_all_reduce(full)
        for fn in cases.values():
            fn()  # warm up (first touch, connections)
        samples = {k: [] for k in cases}
        for _ in range(repeats):
            for k, fn in cases.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                samples[k].append((time.perf_counter() - t0) * 1e3)
        results[mib] = samples
    group.close()
    dist.barrier()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    from _table import table

    from dsrun.ops import shm_comm
    from tests.dist_helpers import free_port
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 192])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--deepspeed", metavar="DIR", help="also time DeepSpeed's shm all_reduce, imported from DIR")
    ap.add_argument("--slot-mib", type=int, default=shm_comm.DEFAULT_SLOT_BYTES >> 20,
                    help="bytes each rank stages per step")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, name = free_port(), f"/dsrun-bench-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args.sizes_mib, args.repeats, name,
                                                   args.slot_mib, args.deepspeed, out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = out.get(timeout=1800)
    for p in procs:
        p.join()
    for mib, samples in results.items():
        print(table(f"{mib} MiB fp32, {args.ranks} ranks, 1 thread each, {args.slot_mib} MiB slots",
                    list(samples.items()), "gloo all_reduce"))
        print()


if __name__ == "__main__":
    main()

"""Pipeline point-to-point: shared-memory channels vs gloo, 2 ranks on this node.

    .venv/bin/python bench/pipeline/p2p_shm.py [--sizes-kib 4 64 1024 16384 65536] [--repeats 7]

Two ranks, one torch thread each, fp32 messages of 4 KiB .. 64 MiB, the two
transports a pipeline StageLink uses between ranks of one node
(p2p.py [Note: the transport of a stage link]):
- "shm": dsrun.ops.shm_comm.ShmChannel, one channel per direction;
- "gloo": torch.distributed isend + irecv().wait() over loopback TCP, as
  StageLink sends without shared memory.
Two patterns per size:
- latency: ping-pong, rank 0 sends, rank 1 sends the message back; one
  sample is a round trip / 2 (one message, sent and received), averaged over
  enough round trips to take a few milliseconds;
- bandwidth: rank 0 streams 8 messages (asynchronous sends, waited at the
  end, as a pipeline stage does), rank 1 receives them and answers with 8
  bytes; one sample is bytes / time.
Every sample is preceded by a barrier; within a repeat the sizes and the two
transports alternate (which goes first alternates too), so load drifts hit
both alike. Printed per size and pattern: min, median and spread
((max - min) / median) of the samples, and gloo's median over shm's.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STREAM = 8  # messages per bandwidth sample


def _round_trips(size: int) -> int:
    """Round trips per latency sample: about 32 MiB of traffic, 2..200."""
    return max(2, min(200, (32 << 20) // size))


def rank_main(rank: int, port: int, sizes: list[int], repeats: int, name: str, slot_bytes: int, slots: int,
              out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from dsrun.ops import shm_comm
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    peer = 1 - rank
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    to_peer = shm_comm.ShmChannel(f"{name}-{rank}", rank, rank, peer, 1, slot_bytes, slots, peer_pid=pids[peer])
    from_peer = shm_comm.ShmChannel(f"{name}-{peer}", rank, peer, rank, 1, slot_bytes, slots, peer_pid=pids[peer])

    def shm_send(t):
        return to_peer.send(t)

    def shm_recv(t):
        from_peer.recv(t)

    def gloo_send(t):
        return dist.isend(t, peer, tag=1)

    def gloo_recv(t):
        dist.irecv(t, peer, tag=1).wait()

    transports = {"shm": (shm_send, shm_recv), "gloo": (gloo_send, gloo_recv)}
    ack = torch.zeros(2, dtype=torch.float32)

    def latency(send, recv, msg, trips):
        t0 = time.perf_counter()
        for _ in range(trips):
            if rank == 0:
                send(msg).wait()
                recv(msg)
            else:
                recv(msg)
                send(msg).wait()
        return (time.perf_counter() - t0) / trips / 2

    def bandwidth(send, recv, msgs):
        t0 = time.perf_counter()
        if rank == 0:
            for h in [send(m) for m in msgs]:
                h.wait()
            recv(ack)
        else:
            for m in msgs:
                recv(m)
            send(ack).wait()
        return sum(m.numel() * 4 for m in msgs) / (time.perf_counter() - t0)

    samples: dict = {}
    for size in sizes:  # warm up: connections, first touch of the rings and buffers
        for send, recv in transports.values():
            latency(send, recv, torch.zeros(size // 4), 1)
    for rep in range(repeats):
        for i, size in enumerate(sizes):
            msg = torch.randn(size // 4)
            msgs = [torch.randn(size // 4) for _ in range(STREAM)]
            order = list(transports) if (rep + i) % 2 == 0 else list(reversed(transports))
            for kind in order:
                send, recv = transports[kind]
                dist.barrier()
                samples.setdefault((size, "latency", kind), []).append(latency(send, recv, msg, _round_trips(size)))
                dist.barrier()
                samples.setdefault((size, "bandwidth", kind), []).append(bandwidth(send, recv, msgs))
    dist.barrier()
    to_peer.close()
    from_peer.close()
    if rank == 0:
        out.put(samples)
    dist.destroy_process_group()


def _human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def report(samples: dict, sizes: list[int]) -> str:
    """The table: per size and pattern, best / median / spread per transport, and the ratio of medians."""
    lines = [(f"{'size':>7} {'pattern':<9} {'transport':<5} {'best':>10} {'median':>10} {'spread':>7}  "
              f"{'gloo/shm':>8}")]
    for size in sizes:
        for pattern, unit, scale in (("latency", "us", 1e6), ("bandwidth", "GB/s", 1e-9)):
            med = {k: statistics.median(samples[(size, pattern, k)]) for k in ("shm", "gloo")}
            for kind in ("shm", "gloo"):
                xs = [x * scale for x in samples[(size, pattern, kind)]]
                best = min(xs) if pattern == "latency" else max(xs)
                m = statistics.median(xs)
                ratio = (med["gloo"] / med["shm"] if pattern == "latency" else med["shm"] / med["gloo"])
                lines.append(f"{_human(size):>7} {pattern:<9} {kind:<5} {best:>10.3g} {m:>10.3g} "
                             f"{(max(xs) - min(xs)) / m:>6.0%}  " + (f"{ratio:>7.2f}x" if kind == "gloo" else "")
                             + f"  ({unit})")
    lines.append("best: the best sample (lowest latency, highest bandwidth); spread = (max - min) / median; "
                 "gloo/shm: how many times shm is faster (median latency ratio, median bandwidth ratio)")
    return "\n".join(lines)


def main() -> None:
    from dsrun.ops import shm_comm
    from tests.dist_helpers import free_port
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 16, 64, 256, 1024, 4096, 16384, 65536])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--slot-kib", type=int, default=shm_comm.CHANNEL_SLOT_BYTES >> 10)
    ap.add_argument("--slots", type=int, default=shm_comm.CHANNEL_SLOTS)
    args = ap.parse_args()
    sizes = [k << 10 for k in args.sizes_kib]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, name = free_port(), f"/dsrun-bench-p2p-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=rank_main, args=(r, port, sizes, args.repeats, name, args.slot_kib << 10,
                                                  args.slots, out)) for r in range(2)]
    for p in procs:
        p.start()
    samples = out.get(timeout=3600)
    for p in procs:
        p.join()
    print(f"2 ranks, 1 torch thread each, fp32; shm ring {args.slots} x {args.slot_kib} KiB; "
          f"{args.repeats} repeats; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(report(samples, sizes))


if __name__ == "__main__":
    main()

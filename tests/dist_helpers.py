"""Run a function on N real gloo ranks (separate processes) and collect the results.

    from tests.dist_helpers import run_ranks
    results = run_ranks(fn, 2, arg1, arg2, timeout=60)   # [fn's return on rank 0, rank 1]

`fn` must be a module-level (picklable) function; each rank is a fresh
spawned interpreter with the rank environment of a launcher (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free
MASTER_PORT) and one torch thread. The rank calls `fn(*args)` -- it is up
to fn to call `dsrun.init_distributed()` / `initialize()`. If any rank
raises, the others are terminated and a RankFailed carrying that rank's
traceback is raised; if they do not finish within `timeout` seconds, all
are terminated and RankFailed says which were still running.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable


class RankFailed(RuntimeError):
    """A rank raised, died, or timed out; the message carries its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: tuple,
               results: "mp.Queue") -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        # Plain pickle copies tensor data; the queue's own pickler would share
        # it through a socket that dies with this process.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def as_nodes(ranks_per_node: int) -> None:
    """Inside a rank of `run_ranks`, before init_distributed: make the ranks
    nodes of `ranks_per_node` consecutive ranks through the rank environment
    (LOCAL_RANK = RANK mod n, LOCAL_WORLD_SIZE = n), as a launcher would on
    several hosts (see dsrun/runtime/nodes.py)."""
    os.environ.update(LOCAL_RANK=str(int(os.environ["RANK"]) % ranks_per_node),
                      LOCAL_WORLD_SIZE=str(ranks_per_node))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; return their results in rank order.

    Raises:
        RankFailed: a rank raised (its traceback is in the message), exited
            without a result, or the ranks ran past `timeout` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise RankFailed(f"ranks {missing} did not finish within {timeout} s")
                dead = [r for r, p in enumerate(procs)
                        if r not in out and p.exitcode is not None]
                if dead:
                    # A rank may have exited right after putting its result; drain once more.
                    try:
                        rank, ok, value = results.get(timeout=1.0)
                    except queue.Empty:
                        raise RankFailed(f"rank {dead[0]} exited with code "
                                         f"{procs[dead[0]].exitcode} without a result") from None
                else:
                    continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]

"""Run a function on N real gloo ranks (separate processes) and collect the results.

    from tests.dist_helpers import run_ranks
    results = run_ranks(fn, 2, arg1, arg2, timeout=60)   # [fn's return on rank 0, rank 1]

`fn` must be a module-level (picklable) function; each rank is a fresh
process with the caller's environment plus the rank environment of a
launcher (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT), the caller's stdout/stderr, and
one torch thread. The rank calls `fn(*args)` -- it is up to fn to call
`dsrun.init_distributed()` / `initialize()`. If any rank raises, the others
are terminated and a RankFailed carrying that rank's traceback is raised; if
they do not finish within `timeout` seconds, all are terminated and
RankFailed says which were still running.

[Note: ranks forked from a torch-loaded server]
Importing torch and torch._dynamo (which the first torch optimizer imports)
costs each rank seconds of CPU, most of a small test's time on 2 cores; the
modules of dsrun's runtime that every rank imports (initialize,
init_distributed, the pipeline, AutoTP) cost it 0.4 s more, and the
Hugging Face model classes the tests build (GPT-2, Llama, Mistral) 1 s
more. The ranks are therefore forked by multiprocessing's forkserver, which
imports these once (a module that cannot be imported, such as transformers
in a venv without it, is skipped) and nothing else: no thread, no process
group and no dsrun state exists before the fork (importing dsrun defines
functions, classes and constants; it starts nothing), so a rank starts as
clean as a spawned one. What a fork would take from the server instead of
the caller is passed explicitly: the environment (os.environ as it is at
the call) and the stdout/stderr file descriptors (pytest's capture of the
current test). One difference remains: a module-level constant computed
from the environment at import (checkpoint/rendezvous.py's timeouts) holds
the environment of the server's start, the first `run_ranks` of the pytest
process; a test that needs another value sets the constant inside the rank.
A forked child ends with os._exit, which skips atexit handlers (dsrun
removes swap directories and stops its communication thread there), so
`RankProcess` runs them when the target returns, as a spawned interpreter's
exit would.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from multiprocessing import reduction
from typing import Any, Callable

# See [Note: ranks forked from a torch-loaded server].
_PRELOAD = ["torch", "torch._dynamo",
            "dsrun.runtime.comm.deepspeed_api", "dsrun.runtime.engine.entry", "dsrun.pipe",
            "dsrun.runtime.parallel.tensor.autotp",
            "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
            "transformers.models.mistral.modeling_mistral"]


class RankFailed(RuntimeError):
    """A rank raised, died, or timed out; the message carries its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stdio:
    """The caller's descriptors 1 and 2 (stdout, stderr), installed in a forked
    rank: pickled while the rank starts, when multiprocessing can pass
    descriptors to it."""

    def __reduce__(self):
        return _Stdio._attach, (reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def _attach(out, err) -> None:
        for fd, target in ((out.detach(), 1), (err.detach(), 2)):
            os.dup2(fd, target)
            os.close(fd)


def context() -> mp.context.BaseContext:
    """The multiprocessing context ranks start in (for its Queue); start
    ranks as `RankProcess`es (see [Note: ranks forked from a torch-loaded
    server])."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class RankProcess(mp.context.ForkServerProcess):
    """A process forked from the torch-loaded forkserver that runs the atexit
    handlers registered in it when its target returns (see [Note: ranks
    forked from a torch-loaded server]). The target must set up its rank
    environment from its arguments, as `_rank_main` does."""

    def start(self) -> None:
        context()  # the server preloads torch
        super().start()

    def _bootstrap(self, *args, **kwargs) -> int:
        code = super()._bootstrap(*args, **kwargs)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
        return code


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: tuple,
               results: "mp.Queue", environ: dict[str, str], stdio: None = None) -> None:
    os.environ.clear()
    os.environ.update(environ)
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
    several hosts (see dsrun/runtime/distributed/nodes.py)."""
    os.environ.update(LOCAL_RANK=str(int(os.environ["RANK"]) % ranks_per_node),
                      LOCAL_WORLD_SIZE=str(ranks_per_node))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; return their results in rank order.

    Raises:
        RankFailed: a rank raised (its traceback is in the message), exited
            without a result, or the ranks ran past `timeout` seconds.
    """
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [RankProcess(target=_rank_main, args=(fn, r, world_size, port, args, results, environ, _Stdio()),
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

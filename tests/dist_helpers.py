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
RankFailed says which were still running. `RankPool` keeps its ranks for
many calls (one start-up and one process group for many small trainings).

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


def _enter_rank(rank: int, world_size: int, port: int, environ: dict[str, str]) -> None:
    """Give this process the rank environment of a launcher and one torch thread."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)


def _run_one(fn: Callable, args: tuple, rank: int, results: "mp.Queue") -> None:
    """Put (rank, True, fn's pickled result) or (rank, False, its traceback) on `results`."""
    try:
        # Plain pickle copies tensor data; the queue's own pickler would share
        # it through a socket that dies with this process.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _leave_world() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: tuple,
               results: "mp.Queue", environ: dict[str, str], stdio: None = None) -> None:
    _enter_rank(rank, world_size, port, environ)
    try:
        _run_one(fn, args, rank, results)
    finally:
        _leave_world()


def _pool_main(rank: int, world_size: int, port: int, jobs: "mp.Queue", results: "mp.Queue",
               environ: dict[str, str], stdio: None = None) -> None:
    """A rank of a RankPool: run (fn, args) jobs from `jobs` until None arrives."""
    _enter_rank(rank, world_size, port, environ)
    try:
        for fn, args in iter(jobs.get, None):
            _run_one(fn, args, rank, results)
    finally:
        _leave_world()


def as_nodes(ranks_per_node: int) -> None:
    """Inside a rank of `run_ranks`, before init_distributed: make the ranks
    nodes of `ranks_per_node` consecutive ranks through the rank environment
    (LOCAL_RANK = RANK mod n, LOCAL_WORLD_SIZE = n), as a launcher would on
    several hosts (see dsrun/runtime/distributed/nodes.py)."""
    os.environ.update(LOCAL_RANK=str(int(os.environ["RANK"]) % ranks_per_node),
                      LOCAL_WORLD_SIZE=str(ranks_per_node))


def _collect(procs: list, results: "mp.Queue", timeout: float) -> list[Any]:
    """The results of `procs` (one per rank) from `results`, in rank order.

    Raises:
        RankFailed: as run_ranks.
    """
    world_size = len(procs)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                raise RankFailed(f"ranks {missing} did not finish within {timeout} s") from None
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
    return [out[r] for r in range(world_size)]


def _stop(procs: list, grace: float) -> None:
    """Wait up to `grace` seconds for each process to end, then kill it."""
    for p in procs:
        p.join(timeout=grace)
        if p.is_alive():
            p.kill()
            p.join()


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
    finished = False
    try:
        out = _collect(procs, results, timeout)
        finished = True
        return out
    finally:
        _stop(procs, 5 if finished else 0.1)


class RankPool:
    """`world_size` ranks started once that run one function after another:
    many small trainings share one start-up and one process group.

        pool = RankPool(4)
        results = pool.run(fn, arg1, timeout=60)   # [fn(arg1) on rank 0, ..., rank 3]
        pool.close()

    Each `run` is like run_ranks on ranks that live on: `fn` must be a
    module-level function, and what one call leaves in the ranks (the
    process group, a current mesh, module state) is there for the next, so
    `fn` undoes what it must. The ranks start on the first `run`, with the
    environment and stdout/stderr of that moment. A call that fails or times
    out ends the ranks (one may be stuck inside a collective the failed rank
    never joined); the next call starts new ones.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[RankProcess] = []

    def _start(self) -> None:
        ctx = context()
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port, environ = free_port(), dict(os.environ)
        self._procs = [RankProcess(target=_pool_main, daemon=True,
                                   args=(r, self.world_size, port, self._jobs[r], self._results, environ, _Stdio()))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Any]:
        """`fn(*args)` on every rank; their results in rank order.

        Raises:
            RankFailed: as run_ranks (the ranks are then ended).
        """
        if not self._procs:
            self._start()
        for jobs in self._jobs:
            jobs.put((fn, args))
        try:
            return _collect(self._procs, self._results, timeout)
        except BaseException:
            self._end(grace=0.1)
            raise

    def close(self) -> None:
        """End the ranks (they leave the process group first)."""
        if self._procs:
            for jobs in self._jobs:
                jobs.put(None)
            self._end(grace=10)

    def _end(self, grace: float) -> None:
        _stop(self._procs, grace)
        self._procs = []


def train_steps(engine, steps: int, loss_of: Callable[[int], Any]) -> tuple[list[float], list[float]]:
    """Inside a rank: `steps` training steps of one micro-batch each, where
    `loss_of(step)` runs this rank's forward through `engine` and returns
    its loss (a scalar tensor). Returns per step the loss averaged over
    every rank of the job (the ranks of one model copy hold the same loss
    and the data ranks equal shares of the batch, so it is the global
    batch's mean) and `engine.get_global_grad_norm()`."""
    import torch.distributed as dist
    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(step)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        norms.append(engine.get_global_grad_norm())
    return losses, norms

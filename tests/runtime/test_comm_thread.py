"""The communication thread (comm/comm_thread.py) and the overlapped collectives.

Stage 0 reduces its gradient buckets with `overlapped_all_reduce`, ZeRO its
regions with `overlapped_reduce_scatter` / `overlapped_all_gather`; on shm
they run on a background thread (DSRUN_COMM_OVERLAP=thread). These tests check
what that must not break: order and results, errors surfacing at wait(),
a dead peer turning into an error instead of a hang, ranks that disagree on
the mode, and a clean process exit with work still queued.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dsrun.runtime.comm import comm_thread
from tests.dist_helpers import free_port, run_ranks

ROOT = Path(__file__).resolve().parents[2]


def test_runs_in_order_and_errors_surface_at_wait() -> None:
    thread = comm_thread.CommThread()
    seen: list[int] = []
    caller = threading.get_ident()
    ran_on: list[int] = []

    def record(i: int):
        def fn():
            seen.append(i)
            ran_on.append(threading.get_ident())
        return fn

    works = [thread.submit(f"op{i}", record(i)) for i in range(20)]
    thread.drain()
    assert seen == list(range(20)) and all(w.is_completed() and w.is_success() for w in works)
    assert caller not in ran_on

    def boom():
        raise ValueError("native call failed")
    failed = thread.submit("all_reduce", boom)
    later = thread.submit("later", record(99))
    with pytest.raises(comm_thread.CommError, match="all_reduce on the communication thread failed") as e:
        failed.wait()
    assert isinstance(e.value.__cause__, ValueError)
    with pytest.raises(comm_thread.CommError, match="not run: an earlier collective failed"):
        later.wait()
    assert 99 not in seen
    with pytest.raises(comm_thread.CommError):
        thread.drain()
    thread.close()
    with pytest.raises(comm_thread.CommError, match="stopped"):
        thread.submit("after close", record(1))


def _overlap_body(average: bool) -> dict:
    import torch.distributed as dist

    from dsrun.runtime.comm import collectives, comms_logger

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert collectives.uses_shm()
    comms_logger.reset()
    big = [torch.full((3_000_000,), float(rank + 1 + i)) for i in range(4)]
    handles = [collectives.overlapped_all_reduce(t, average=average) for t in big]
    # A main-thread shm collective issued while the thread still works: it
    # must run after the queued ones, in the same order on both ranks.
    small = torch.tensor([float(rank)])
    collectives.all_reduce(small)
    for h in handles:
        h.wait()
    stats = comms_logger.snapshot()["all_reduce"]
    return {"mode": collectives._WorldShm.overlap, "big": [(t.min().item(), t.max().item()) for t in big],
            "small": small.item(), "calls": stats.calls, "transports": stats.transports}


@pytest.mark.parametrize("mode", ["thread", "sync", "torch"])
def test_overlapped_all_reduce_modes(monkeypatch, mode: str) -> None:
    monkeypatch.setenv("DSRUN_COMM_OVERLAP", mode)
    for average in (True, False):
        results = run_ranks(_overlap_body, 2, average)
        for r in results:
            assert r["mode"] == mode
            for i, (lo, hi) in enumerate(r["big"]):
                expected = (1 + i + 2 + i) / (2 if average else 1)
                assert lo == hi == expected
            assert r["small"] == 1.0 and r["calls"] == 5
            assert r["transports"] == ({"torch": 4, "shm": 1} if mode == "torch" else {"shm": 5})


def _region_body() -> dict:
    """ZeRO's overlapped batches: reduce-scatters whose outputs alias the
    input (stage 1) or not (stages 2-3), all-gathers whose input is the own
    slice of the output, with a main-thread collective issued in between."""
    import torch.distributed as dist

    from dsrun.runtime.comm import collectives, comms_logger

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comms_logger.reset()
    n = 1_000_000
    full = [torch.arange(2 * n, dtype=torch.float32) * (rank + 1) + i for i in range(3)]
    own = [f[rank * n:(rank + 1) * n] for f in full[:2]] + [torch.empty(n)]
    rs = collectives.overlapped_reduce_scatter(list(zip(own, full)))
    small = torch.tensor([float(rank)])
    collectives.all_reduce(small)  # waits for the queued batch, runs after it on both ranks
    gathered = torch.zeros(2 * n)
    gathered[rank * n:(rank + 1) * n] = rank + 1
    ag = collectives.overlapped_all_gather([(gathered, gathered[rank * n:(rank + 1) * n])])
    rs.wait()
    ag.wait()
    base = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) * 3
    stats = comms_logger.snapshot()
    return {"rs_exact": [bool(torch.equal(o, base + 2 * i)) for i, o in enumerate(own)],
            "ag": (gathered[:n].unique().tolist(), gathered[n:].unique().tolist()), "small": small.item(),
            "rs_calls": stats["reduce_scatter_tensor"].calls, "ag_calls": stats["all_gather_into_tensor"].calls,
            "transports": stats["reduce_scatter_tensor"].transports}


@pytest.mark.parametrize("mode", ["thread", "sync", "torch"])
def test_overlapped_reduce_scatter_and_all_gather_modes(monkeypatch, mode: str) -> None:
    monkeypatch.setenv("DSRUN_COMM_OVERLAP", mode)
    for r in run_ranks(_region_body, 2):
        assert r["rs_exact"] == [True, True, True]
        assert r["ag"] == ([1.0], [2.0]) and r["small"] == 1.0
        assert r["rs_calls"] == 3 and r["ag_calls"] == 1
        assert r["transports"] == {"torch" if mode == "torch" else "shm": 3}


def _disagree_body() -> dict:
    os.environ["DSRUN_COMM_OVERLAP"] = "thread" if int(os.environ["RANK"]) == 0 else "torch"
    return _overlap_body(True)


def test_ranks_that_disagree_fall_back_to_sync() -> None:
    for r in run_ranks(_disagree_body, 2):
        assert r["mode"] == "sync" and r["big"][0] == (1.5, 1.5)


def _worker(scenario: str) -> None:
    """One rank of a scenario run in its own interpreter (exit codes are the test)."""
    import torch.distributed as dist

    from dsrun.runtime.comm import collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    assert collectives.uses_shm() and collectives._WorldShm.overlap == "thread"
    rank = dist.get_rank()
    if scenario == "exit_with_queued_work":
        # Never waited on: the atexit hook lets the thread finish before teardown.
        for _ in range(4):
            collectives.overlapped_all_reduce(torch.ones(2_000_000), average=True)
        print(f"rank {rank} leaving", flush=True)
        return
    if scenario == "peer_dies":
        if rank == 1:
            os._exit(3)
        t0 = time.monotonic()
        handle = collectives.overlapped_all_reduce(torch.ones(1_000_000))
        try:
            handle.wait()
        except comm_thread.CommError as e:
            print(f"raised after {time.monotonic() - t0:.1f} s: {e}; cause {type(e.__cause__).__name__}",
                  flush=True)
            os._exit(0)
        os._exit(1)


def _run_pair(scenario: str) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DSRUN_COMM_OVERLAP="thread",
                   DSRUN_SHM_TIMEOUT="30")
        code = f"from tests.runtime.test_comm_thread import _worker; _worker({scenario!r})"
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_exit_is_clean_with_work_still_queued() -> None:
    for rank, p in enumerate(_run_pair("exit_with_queued_work")):
        assert p.returncode == 0, p.stderr
        assert f"rank {rank} leaving" in p.stdout and "Traceback" not in p.stderr, p.stderr


def test_dead_peer_raises_at_wait() -> None:
    survivor, dead = _run_pair("peer_dies")
    assert dead.returncode == 3
    assert survivor.returncode == 0, survivor.stdout + survivor.stderr
    assert "ShmCollectiveError" in survivor.stdout and "exited" in survivor.stdout, survivor.stdout

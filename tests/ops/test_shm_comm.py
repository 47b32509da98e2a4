"""Shared-memory collectives (dsrun.ops.shm_comm) on real processes, 2 and 3 ranks."""
from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

from dsrun.ops import shm_comm
from dsrun.ops.builder import get_op
from tests.dist_helpers import RankProcess, context, free_port, run_ranks

SIZES = [0, 1, 3001]  # with 4 KiB slots 3001 elements take several steps
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def native_shm():
    assert get_op("shm_comm").load() is not None, f"shm_comm did not build: {get_op('shm_comm').reason}"


def _data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + n)).mul_(3).to(dtype)


def _expected_reduce(world: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    # fp32 accumulation in rank order, rounded once: what every rank must get, bit for bit.
    acc = _data(0, n, dtype).float()
    for r in range(1, world):
        x = _data(r, n, dtype).float()
        acc = acc + x if op == "sum" else torch.maximum(acc, x) if op == "max" else torch.minimum(acc, x)
    return acc.to(dtype)


def _group(name: str, slot_bytes: int) -> shm_comm.ShmGroup:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return shm_comm.ShmGroup(name, dist.get_rank(), dist.get_world_size(), barrier=dist.barrier,
                             slot_bytes=slot_bytes)


def _all_collectives(name: str) -> str:
    import torch.distributed as dist
    g = _group(name, slot_bytes=4096)
    rank, world = g.rank, g.world_size
    for dtype in DTYPES:
        for n in SIZES:
            for op in ("sum", "max", "min"):
                t = _data(rank, n, dtype)
                g.all_reduce(t, op)
                assert torch.equal(t, _expected_reduce(world, n, dtype, op)), (dtype, n, op)
            # reduce_scatter: rank r's input is the concatenation over j of _data(r, n, dtype) shifted by j
            inp = torch.cat([_data(rank, n, dtype) * (j + 1) for j in range(world)])
            out = torch.empty(n, dtype=dtype)
            g.reduce_scatter(out, inp)
            acc = (_data(0, n, dtype) * (rank + 1)).float()
            for r in range(1, world):
                acc = acc + (_data(r, n, dtype) * (rank + 1)).float()
            assert torch.equal(out, acc.to(dtype)), ("reduce_scatter", dtype, n)
            gathered = torch.empty(world * n, dtype=dtype)
            g.all_gather(gathered, _data(rank, n, dtype))
            assert torch.equal(gathered, torch.cat([_data(r, n, dtype) for r in range(world)])), ("all_gather", n)
            for src in range(world):
                b = _data(rank, n, dtype)
                g.broadcast(b, src)
                assert torch.equal(b, _data(src, n, dtype)), ("broadcast", src)
    # The fallback is gloo: the same sums, up to rounding (gloo rounds 16-bit
    # partial sums, which are ~9 here: a bf16 ulp there is 0.0625).
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.13), (torch.float16, 0.02)):
        a, b = _data(rank, 3001, dtype), _data(rank, 3001, dtype)
        g.all_reduce(a)
        dist.all_reduce(b)
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol)
    # In place, as ZeRO calls them: gather into a buffer holding this rank's
    # piece, reduce-scatter into this rank's piece of the input.
    full = torch.zeros(world * 1001)
    full[rank * 1001:(rank + 1) * 1001] = rank + 1.0
    g.all_gather(full, full[rank * 1001:(rank + 1) * 1001])
    assert torch.equal(full, torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(1001))
    piece = full[rank * 1001:(rank + 1) * 1001]
    g.reduce_scatter(piece, full)
    assert torch.equal(piece, torch.full((1001,), float(world * (rank + 1))))
    # Any dtype moves through all_gather and broadcast; a 2-D tensor reduces in place.
    ints = torch.arange(10, dtype=torch.int64) + rank
    out = torch.empty(10 * world, dtype=torch.int64)
    assert torch.equal(g.all_gather(out, ints), torch.cat([torch.arange(10) + r for r in range(world)]))
    m = torch.full((3, 5), float(rank))
    g.all_reduce(m)
    assert torch.equal(m, torch.full((3, 5), float(sum(range(world)))))
    # The name is gone as soon as everyone attached: nothing to leak.
    assert not os.path.exists("/dev/shm" + name)
    with pytest.raises(ValueError, match="input must have world_size"):
        g.reduce_scatter(torch.empty(3), torch.empty(3 * world + 1))
    g.close()
    dist.barrier()
    return "ok"


def _from_env(job: str) -> list[float]:
    import torch.distributed as dist
    os.environ["DSRUN_JOB_ID"] = job
    dist.init_process_group("gloo")
    g = shm_comm.world_group_from_env(dist.barrier)
    t = torch.full((5,), float(dist.get_rank()))
    g.all_reduce(t)
    return t.tolist()


def test_world_group_from_env(monkeypatch):
    # run_ranks sets LOCAL_WORLD_SIZE == WORLD_SIZE: every rank is local.
    assert run_ranks(_from_env, 2, uuid.uuid4().hex[:8], timeout=120) == [[1.0] * 5] * 2
    # Ranks on two nodes (or LOCAL_WORLD_SIZE unknown): no shm group, gloo stays.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert shm_comm.world_group_from_env(lambda: None) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert shm_comm.world_group_from_env(lambda: None) is None


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_reference(world):
    name = shm_comm.segment_name(uuid.uuid4().hex[:8], f"test{world}")
    assert run_ranks(_all_collectives, world, name, timeout=180) == ["ok"] * world
    assert not os.path.exists("/dev/shm" + name)


def _crash_rank(rank: int, world: int, port: int, name: str, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    g = _group(name, slot_bytes=1 << 16)
    g.all_reduce(torch.ones(100))  # one good collective first
    if rank == world - 1:
        os._exit(3)  # dies without a word, like a SIGKILLed rank
    start = time.monotonic()
    try:
        g.all_reduce(torch.ones(1 << 20))
        results.put((rank, "no error", 0.0))
    except shm_comm.ShmCollectiveError as e:
        results.put((rank, str(e), time.monotonic() - start))


def test_crash_of_one_rank_is_an_error_not_a_hang():
    world = 3
    name = shm_comm.segment_name(uuid.uuid4().hex[:8], "crash")
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [RankProcess(target=_crash_rank, args=(r, world, port, name, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=120) for _ in range(world - 1))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert procs[-1].exitcode == 3
    for rank, message, waited in got:
        # Every survivor names the dead rank (seen directly or through the abort flag).
        assert f"rank {world - 1}" in message and ("exited" in message or "failed" in message), message
        assert waited < 30
    assert not os.path.exists("/dev/shm" + name)  # removed although a rank crashed


def test_segment_names_are_safe():
    assert shm_comm.segment_name("job/1 2", "dp:0") == "/dsrun-job_1_2-dp_0"


def _all_to_all_vs_gloo(name: str) -> str:
    """shm all_to_all against gloo's all_to_all_single: equal and uneven
    blocks, several steps (4 KiB slots), empty blocks, any dtype."""
    import torch.distributed as dist
    g = _group(name, slot_bytes=4096)
    rank, world = g.rank, g.world_size
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (0, 1, 700):  # elements per block; 700 fp32 take several 4 KiB steps at 4 ranks
            inp = _data(rank, world * n, torch.float32).mul(10).to(dtype)
            ours, ref = torch.empty_like(inp), torch.empty_like(inp)
            g.all_to_all(ours, inp)
            dist.all_to_all_single(ref, inp)
            assert torch.equal(ours, ref), ("equal", dtype, n)
    # Uneven rows of a 2-D tensor: rank i sends (i + 2 j) % 5 * 37 rows to rank j (some zero).
    width = 3
    send = [(rank + 2 * j) % 5 * 37 for j in range(world)]
    recv = [(i + 2 * rank) % 5 * 37 for i in range(world)]
    inp = _data(rank, sum(send) * width, torch.float32).view(-1, width)
    ours, ref = inp.new_empty(sum(recv), width), inp.new_empty(sum(recv), width)
    g.all_to_all(ours, inp, recv, send)
    dist.all_to_all_single(ref, inp, recv, send)
    assert torch.equal(ours, ref), "uneven"
    with pytest.raises(ValueError, match="same number of elements"):
        g.all_to_all(torch.empty(world * 2), torch.empty(world * 3))
    # Split sizes that do not agree between ranks: the receiver that sees it
    # fails at once, the others at their next call on the group.
    send = [1] * world
    if rank == 0:
        send[1] = 2
    try:
        g.all_to_all(torch.empty(world), torch.ones(sum(send)), [1] * world, send)
        g.barrier()
        got = "no error"
    except shm_comm.ShmCollectiveError as e:
        got = str(e)
    expected = "rank 0 sends 8 bytes to rank 1, which expects 4" if rank == 1 else "rank 1 failed"
    assert expected in got, got
    g.close()
    dist.barrier()
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_matches_gloo(world):
    name = shm_comm.segment_name(uuid.uuid4().hex[:8], f"a2a{world}")
    assert run_ranks(_all_to_all_vs_gloo, world, name, timeout=180) == ["ok"] * world
    assert not os.path.exists("/dev/shm" + name)


def _arrive_then_exit(rank: int, world: int, port: int, name: str, go, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    g = _group(name, slot_bytes=1 << 16)
    g.all_reduce(torch.ones(100))
    if rank == 1:
        go.wait()
        g.barrier()
        os._exit(0)  # arrived, then gone before rank 0 looks again
    results.put((rank, "waiting"))
    try:
        g.barrier()
        results.put((rank, "ok"))
    except shm_comm.ShmCollectiveError as e:
        results.put((rank, str(e)))


def test_a_rank_that_arrived_then_exited_does_not_fail_the_waiter():
    # Rank 0 waits in a barrier and is stopped; rank 1 arrives and exits; rank 0
    # resumes to find rank 1 dead but arrived (a SIGKILLed rank right after its
    # last collective, seen in tests/offload/test_swap_files.py): not an error.
    import signal
    name = shm_comm.segment_name(uuid.uuid4().hex[:8], "arrived")
    ctx = context()
    results, go = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [RankProcess(target=_arrive_then_exit, args=(r, 2, port, name, go, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert results.get(timeout=120) == (0, "waiting")
        time.sleep(0.5)  # rank 0 is past its spins, asleep on rank 1's word
        os.kill(procs[0].pid, signal.SIGSTOP)
        go.set()
        procs[1].join(timeout=60)
        assert procs[1].exitcode == 0
        time.sleep(0.05)
        os.kill(procs[0].pid, signal.SIGCONT)
        assert results.get(timeout=60) == (0, "ok")
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(timeout=10)

"""Shared-memory point-to-point channels (dsrun.ops.shm_comm.ShmChannel) on 2
real processes: ordered streams per (sender, receiver, tag) in both
directions at once, messages larger than the ring, and clear errors for a
dead peer, a peer that never sends, and a size mismatch."""
from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

from dsrun.ops import shm_comm
from dsrun.ops.builder import get_op
from tests.dist_helpers import RankProcess, context, free_port, run_ranks

SLOT, SLOTS = 4096, 4  # a 16 KiB ring: most messages below take several laps
SIZES = [0, 1, 7, 1024, 4096, 5000, 16384, 40000]  # elements
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


@pytest.fixture(scope="module", autouse=True)
def native_shm():
    assert get_op("shm_comm").load() is not None, f"shm_comm did not build: {get_op('shm_comm').reason}"


def _message(src: int, tag: int, i: int) -> torch.Tensor:
    """The i-th message of stream (src, tag): its size and dtype vary with i."""
    n, dtype = SIZES[(i + tag) % len(SIZES)], DTYPES[i % len(DTYPES)]
    g = torch.Generator().manual_seed(10000 * src + 1000 * tag + i)
    return (torch.randn(n, generator=g) * 100).to(dtype)


def _setup(name: str):
    """(rank, peer, [pid of rank 0, pid of rank 1]) after a gloo init."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    rank = dist.get_rank()
    return rank, 1 - rank, pids


def _channels(name: str, rank: int, peer: int, pids: list[int], tags, timeout_s: float = 60.0):
    out = {tag: shm_comm.ShmChannel(f"{name}-{rank}-{tag}", rank, rank, peer, tag, SLOT, SLOTS,
                                    peer_pid=pids[peer], timeout_s=timeout_s) for tag in tags}
    inp = {tag: shm_comm.ShmChannel(f"{name}-{peer}-{tag}", rank, peer, rank, tag, SLOT, SLOTS,
                                    peer_pid=pids[peer], timeout_s=timeout_s) for tag in tags}
    return out, inp


def _close(*ends: dict) -> None:
    for end in ends:
        for ch in end.values():
            ch.close()


def _streams(name: str, count: int) -> int:
    import torch.distributed as dist
    rank, peer, pids = _setup(name)
    out, inp = _channels(name, rank, peer, pids, (1, 2))
    handles, received = [], 0
    for i in range(count):
        # Both ranks send before receiving, messages larger than the ring
        # included: a send must not wait for its receiver.
        handles += [out[1].send(_message(rank, 1, i)), out[2].send(_message(rank, 2, i))]
        for tag in (2, 1):  # the other order than sent: the two streams are independent
            want = _message(peer, tag, i)
            got = inp[tag].recv(torch.empty_like(want))
            assert torch.equal(got, want), (rank, tag, i)
            received += 1
    for h in handles:
        assert h.wait()
    dist.barrier()
    _close(out, inp)
    return received


def test_ordered_streams_both_directions_two_tags():
    count = 3 * len(SIZES)
    assert run_ranks(_streams, 2, f"/dsrun-test-t{uuid.uuid4().hex[:8]}", count, timeout=120) == [2 * count, 2 * count]


def _crash_rank(rank: int, port: int, name: str, sends: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rank, peer, pids = _setup(name)
    out, inp = _channels(name, rank, peer, pids, (1,), timeout_s=60.0)
    if rank == 0:
        for i in range(sends):
            out[1].send(_message(0, 1, i)).wait()
        os._exit(3)  # dies without closing anything, like a SIGKILLed rank
    for i in range(sends):
        want = _message(0, 1, i)
        assert torch.equal(inp[1].recv(torch.empty_like(want)), want)
    started = time.monotonic()
    try:
        inp[1].recv(torch.empty(4))
        results.put("no error")
    except shm_comm.ShmChannelError as e:
        results.put((str(e), time.monotonic() - started))


@pytest.mark.parametrize("sends", [0, 2])
def test_receiver_names_a_dead_sender(sends):
    """The sender dies before creating the channel (0 sends) or after 2
    messages: the receiver gets those and then fails fast, naming it."""
    name = f"/dsrun-test-d{uuid.uuid4().hex[:8]}"
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [RankProcess(target=_crash_rank, args=(r, port, name, sends, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        message, seconds = results.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert procs[0].exitcode == 3
    assert "rank 0" in message and "exited while rank 1 waited" in message, message
    assert seconds < 20, seconds  # the timeout is 60 s
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(name[1:])], "segments are freed"


def _sender_closes(name: str):
    rank, peer, pids = _setup(name)
    out, inp = _channels(name, rank, peer, pids, (1,), timeout_s=60.0)
    if rank == 0:
        out[1].send(torch.ones(3)).wait()
        out[1].close()  # before rank 1 attached: the message stays readable
        return None
    assert torch.equal(inp[1].recv(torch.empty(3)), torch.ones(3))
    with pytest.raises(shm_comm.ShmChannelError) as info:
        inp[1].recv(torch.empty(3))
    _close(out)
    return str(info.value)


def test_receiver_sees_a_closed_channel():
    _, message = run_ranks(_sender_closes, 2, f"/dsrun-test-c{uuid.uuid4().hex[:8]}")
    assert "rank 0" in message and ("closed the channel" in message or "exited" in message), message


def _silent_sender(name: str):
    import torch.distributed as dist
    rank, peer, pids = _setup(name)
    out, inp = _channels(name, rank, peer, pids, (1,), timeout_s=1.0)
    result = None
    if rank == 1:
        started = time.monotonic()
        with pytest.raises(shm_comm.ShmChannelError) as info:
            inp[1].recv(torch.empty(4))
        result = (str(info.value), time.monotonic() - started)
    dist.barrier()  # rank 0 stays alive, sending nothing, until rank 1 gave up
    _close(out, inp)
    return result


def test_receiver_times_out_on_a_live_silent_sender():
    _, (message, seconds) = run_ranks(_silent_sender, 2, f"/dsrun-test-s{uuid.uuid4().hex[:8]}")
    assert "timed out after 1 s" in message and "rank 1" in message and "DSRUN_SHM_TIMEOUT" in message, message
    assert 0.9 < seconds < 15, seconds


def _mismatch(name: str):
    import torch.distributed as dist
    rank, peer, pids = _setup(name)
    out, inp = _channels(name, rank, peer, pids, (2,))
    result = None
    if rank == 0:
        out[2].send(torch.zeros(4)).wait()
    else:
        with pytest.raises(shm_comm.ShmChannelError) as info:
            inp[2].recv(torch.empty(8))
        result = str(info.value)
        with pytest.raises(shm_comm.ShmChannelError, match="failed earlier"):
            inp[2].recv(torch.empty(4))
    dist.barrier()
    _close(out, inp)
    return result


def test_size_mismatch_names_both_sizes():
    _, message = run_ranks(_mismatch, 2, f"/dsrun-test-m{uuid.uuid4().hex[:8]}")
    assert "rank 0 sent 16 bytes" in message and "rank 1 expected 32 bytes" in message, message


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="neither end"):
        shm_comm.ShmChannel("/dsrun-test-bad", 2, 0, 1, 1)
    with pytest.raises(ValueError, match="multiple of 64"):
        shm_comm.ShmChannel("/dsrun-test-bad", 0, 0, 1, 1, slot_bytes=100)
    ch = shm_comm.ShmChannel(f"/dsrun-test-{uuid.uuid4().hex[:8]}", 0, 0, 1, 1, SLOT, SLOTS)
    with pytest.raises(ValueError, match="only rank 1 may recv"):
        ch.recv(torch.empty(1))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        ch.send(torch.zeros(4, 4).t())
    ch.close()
    assert not any(n.startswith(ch.name[1:]) for n in os.listdir("/dev/shm")), "an unattached segment is removed"

"""Shared memory serving subgroups and the all-to-all (comm/collectives.py
[Note: choosing the transport]) on 2 and 4 real ranks: every collective on
the world and on subgroups gives gloo's results (DSRUN_SHM_COMM=0 in the
same test), runs on shm, and a rank that cannot use shm for a group makes
every member of that group fall back."""
from __future__ import annotations

import os

import pytest
import torch

from dsrun.ops.builder import get_op
from tests.dist_helpers import run_ranks

N = 1001


@pytest.fixture(scope="module", autouse=True)
def native_shm():
    assert get_op("shm_comm").load() is not None, f"shm_comm did not build: {get_op('shm_comm').reason}"


def _data(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(11 * rank + n)).mul_(5).to(dtype)


def _subgroups(world: int) -> list[list[list[int]]]:
    """Blocks and strided groups (expert and expert-data groups are of these forms)."""
    if world == 2:
        return [[[0, 1]]]
    half = world // 2
    return [[list(range(i, i + half)) for i in range(0, world, half)], [list(range(i, world, half)) for i in range(half)]]


def _collectives(shm_env: str) -> dict:
    os.environ["DSRUN_SHM_COMM"] = shm_env
    import torch.distributed as dist

    import dsrun
    from dsrun.runtime import comm
    from dsrun.runtime.comm.list_collectives import all_to_all_single_split

    dsrun.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    groups = [(None, list(range(world)))]
    for layout in _subgroups(world):
        made = [dist.new_group(ranks) for ranks in layout]
        groups += [(g, ranks) for g, ranks in zip(made, layout) if rank in ranks]
    out: dict = {}
    for k, (group, ranks) in enumerate(groups):
        size, me = len(ranks), ranks.index(rank)
        t = _data(rank, N)
        comm.all_reduce(t, group=group)
        out[f"{k} all_reduce"] = t
        t = _data(rank, N, torch.bfloat16)
        comm.all_reduce(t, op=comm.ReduceOp.MAX, group=group)
        out[f"{k} all_reduce max"] = t
        shard = torch.empty(N)
        comm.reduce_scatter_tensor(shard, _data(rank, N * size), group=group)
        out[f"{k} reduce_scatter"] = shard
        gathered = torch.empty(N * size)
        comm.all_gather_into_tensor(gathered, _data(rank, N), group=group)
        out[f"{k} all_gather"] = gathered
        t = _data(rank, N)
        comm.broadcast(t, src=ranks[-1], group=group)  # a global rank, not the group rank
        out[f"{k} broadcast"] = t
        inp = _data(rank, N * size)
        got = torch.empty_like(inp)
        comm.all_to_all_single(got, inp, group=group)
        out[f"{k} all_to_all"] = got
        send = [(me + 2 * j) % 3 * 5 for j in range(size)]  # uneven rows of 4, some empty
        recv = [(i + 2 * me) % 3 * 5 for i in range(size)]
        inp = _data(rank, sum(send) * 4).view(-1, 4)
        got = inp.new_empty(sum(recv), 4)
        all_to_all_single_split(got, inp, recv, send, group=group)
        out[f"{k} all_to_all uneven"] = got
        handle = comm.collectives.overlapped_all_reduce(_data(rank, N), group=group, average=True)
        handle.wait()
    out["transports"] = {op: s.transports for op, s in comm.comms_logger.snapshot().items()}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_world_and_subgroups_match_gloo(world):
    shm = run_ranks(_collectives, world, "1", timeout=180)
    gloo = run_ranks(_collectives, world, "0", timeout=180)
    groups = 1 + len(_subgroups(world))  # collectives each rank made on each transport, per group
    for r in range(world):
        ops = shm[r]["transports"]
        for op in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast"):
            assert set(ops[op]) == {"shm"}, (op, ops[op])
        assert ops["all_to_all_single"] == {"shm": 2 * groups}
        assert set().union(*(gloo[r]["transports"][op] for op in ops)) == {"torch"}
        for key, value in gloo[r].items():
            if isinstance(value, torch.Tensor):
                if "all_reduce" in key or "reduce_scatter" in key:
                    # fp32 sums in another order than gloo's: equal to rounding.
                    torch.testing.assert_close(shm[r][key], value, rtol=1e-6, atol=1e-5, msg=key)
                else:
                    assert torch.equal(shm[r][key], value), key


def _one_rank_refuses(ranks_refusing: list[int]) -> dict:
    """Rank(s) in `ranks_refusing` cannot use shm (DSRUN_SHM_COMM=0 there)."""
    import torch.distributed as dist

    import dsrun
    from dsrun.runtime import comm

    if int(os.environ["RANK"]) in ranks_refusing:
        os.environ["DSRUN_SHM_COMM"] = "0"
    dsrun.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    pairs = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]
    pair = pairs[rank // 2]
    t = torch.full((N,), float(rank))
    comm.all_reduce(t, group=pair)
    inp = torch.arange(4.0) + 10 * rank
    got = torch.empty(4)
    comm.all_to_all_single(got, inp, group=pair)
    return {"sum": t[0].item(), "a2a": got.tolist(), "pair_shm": comm.uses_shm(pair), "world_shm": comm.uses_shm(),
            "transports": comm.comms_logger.snapshot()["all_to_all_single"].transports}


def test_a_rank_that_cannot_use_shm_makes_its_group_fall_back():
    got = run_ranks(_one_rank_refuses, 4, [3], timeout=120)
    for r in range(4):
        low = r // 2 * 2
        assert got[r]["sum"] == 2 * low + 1
        assert got[r]["a2a"] == [10 * low + 2 * (r % 2), 10 * low + 2 * (r % 2) + 1,
                                 10 * (low + 1) + 2 * (r % 2), 10 * (low + 1) + 2 * (r % 2) + 1]
        assert got[r]["world_shm"] is False  # rank 3 refuses: nobody uses shm on the world
        # The pair without rank 3 still uses shm; rank 3's pair falls back on both members.
        assert got[r]["pair_shm"] is (r < 2)
        assert got[r]["transports"] == ({"shm": 1} if r < 2 else {"torch": 1})

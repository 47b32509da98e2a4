"""The communication layer's shared-memory transport (comm/collectives.py
[Note: choosing the transport]) on 2 real ranks: chosen on one node, same
results as gloo, serves subgroups too, falls back per call, and
DSRUN_SHM_COMM=0 turns it off."""
from __future__ import annotations

import pytest
import torch

from dsrun.ops.builder import get_op
from tests.dist_helpers import run_ranks

DTYPES = (torch.float32, torch.bfloat16)
N = 1001  # odd, so the reduce-scatter / all-gather shards are not round numbers


@pytest.fixture(scope="module", autouse=True)
def native_shm():
    assert get_op("shm_comm").load() is not None, f"shm_comm did not build: {get_op('shm_comm').reason}"


def _data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(7 * rank + n)).mul_(5).to(dtype)


def _collectives(shm_env: str) -> dict:
    """Every collective on fp32 and bf16 plus the fallbacks; returns results and transports."""
    import os

    os.environ["DSRUN_SHM_COMM"] = shm_env
    import torch.distributed as dist

    import dsrun
    from dsrun.runtime import comm
    from dsrun.runtime.zero import collectives as zero_collectives
    from dsrun.runtime.zero.groups import RankGroup

    dsrun.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    out: dict = {"uses_shm": comm.uses_shm(), "zero_all_reduce": zero_collectives.uses_all_reduce(RankGroup.of(None))}
    for dtype in DTYPES:
        name = str(dtype).split(".")[1]
        for op in (comm.ReduceOp.SUM, comm.ReduceOp.MAX):
            t = _data(rank, N, dtype)
            comm.all_reduce(t, op=op)
            out[f"all_reduce_{op}_{name}"] = t
        t = _data(rank, N * world, dtype)
        shard = torch.empty(N, dtype=dtype)
        comm.reduce_scatter_tensor(shard, t)
        out[f"reduce_scatter_{name}"] = shard
        gathered = torch.empty(N * world, dtype=dtype)
        handle = comm.all_gather_into_tensor(gathered, _data(rank, N, dtype), async_op=True)
        handle.wait()
        out[f"all_gather_{name}"] = gathered
        t = _data(rank, N, dtype)
        comm.broadcast(t, src=1)
        out[f"broadcast_{name}"] = t
    main = comm.comms_logger.snapshot()
    out["main_transports"] = {op: s.transports for op, s in main.items()}
    out["main_bytes"] = {op: s.bytes for op, s in main.items()}

    # A subgroup on this node is served too; an unsupported dtype and an
    # unsupported op stay on torch.distributed.
    comm.comms_logger.reset()
    sub = dist.new_group(ranks=list(range(world)))
    t = _data(rank, N, torch.float32)
    comm.all_reduce(t, group=sub)
    out["subgroup_sum"] = t
    out["subgroup_transports"] = comm.comms_logger.snapshot()["all_reduce"].transports
    comm.comms_logger.reset()
    t = _data(rank, N, torch.float64)
    comm.all_reduce(t)
    out["float64_sum"] = t
    t = torch.arange(N, dtype=torch.int64) * (rank + 1)
    comm.all_reduce(t, op=comm.ReduceOp.PRODUCT)
    out["int64_product"] = t
    out["fallback_transports"] = comm.comms_logger.snapshot()["all_reduce"].transports
    return out


def test_shm_transport_matches_gloo_and_falls_back():
    shm, gloo = run_ranks(_collectives, 2, "1", timeout=60), run_ranks(_collectives, 2, "0", timeout=60)
    for r in range(2):
        assert shm[r]["uses_shm"] and not gloo[r]["uses_shm"]
        # ZeRO uses the native reduce-scatter/all-gather on shm, all_reduce emulation on gloo.
        assert shm[r]["zero_all_reduce"] is False and gloo[r]["zero_all_reduce"] is True
        # 2 dtypes x (2 all_reduce, 1 of each other op), every one on the chosen transport.
        expected = {"all_reduce": 4, "reduce_scatter_tensor": 2, "all_gather_into_tensor": 2, "broadcast": 2}
        assert shm[r]["main_transports"] == {op: {"shm": n} for op, n in expected.items()}
        assert gloo[r]["main_transports"] == {op: {"torch": n} for op, n in expected.items()}
        assert shm[r]["main_bytes"] == gloo[r]["main_bytes"]  # same accounting on either transport
        assert shm[r]["fallback_transports"] == {"torch": 2} == gloo[r]["fallback_transports"]
        assert shm[r]["subgroup_transports"] == {"shm": 1} and gloo[r]["subgroup_transports"] == {"torch": 1}
        for key, value in gloo[r].items():
            if isinstance(value, torch.Tensor):
                # Two ranks: one rounding of the exact sum either way, so bit-identical.
                assert torch.equal(shm[r][key], value), key
    for key, value in shm[0].items():
        if isinstance(value, torch.Tensor) and not key.startswith("reduce_scatter"):
            assert torch.equal(value, shm[1][key]), key
    assert torch.equal(shm[0]["broadcast_float32"], _data(1, N, torch.float32))
    expected_gather = torch.cat([_data(0, N, torch.bfloat16), _data(1, N, torch.bfloat16)])
    assert torch.equal(shm[1]["all_gather_bfloat16"], expected_gather)

"""`import dsrun.comm as dist`: DeepSpeed's comm API on 2 gloo ranks, every call counted."""
from __future__ import annotations

import datetime

import torch

from tests.dist_helpers import run_ranks


def _collectives() -> dict:
    import dsrun.comm as dist
    from dsrun.accelerator import get_accelerator
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False,
                          timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.comms_logger.reset()
    out = {}
    t = torch.full((2,), float(rank + 1))
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, t)
    out["all_gather"] = [g.tolist() for g in gathered]
    flat = torch.zeros(2 * world)
    dist.all_gather_into_tensor(flat, t)
    out["all_gather_into_tensor"] = flat.tolist()
    shard = torch.zeros(2)
    dist.reduce_scatter_tensor(shard, torch.arange(4.0) * (rank + 1))
    out["reduce_scatter_tensor"] = shard.tolist()
    a2a = torch.zeros(4)
    dist.all_to_all_single(a2a, torch.arange(4.0) + 10 * rank)
    out["all_to_all_single"] = a2a.tolist()
    # uneven: rank 0 sends 1 row to 0 and 3 to 1; rank 1 sends 2 and 2
    splits = [[1, 3], [2, 2]]
    recv = [splits[0][rank], splits[1][rank]]
    uneven = torch.zeros(sum(recv))
    dist.all_to_all_single(uneven, torch.arange(4.0) + 10 * rank, output_split_sizes=recv,
                           input_split_sizes=splits[rank])
    out["all_to_all_uneven"] = uneven.tolist()
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)
    out["broadcast"] = b.item()
    r = torch.tensor([float(rank + 1)])
    dist.reduce(r, dst=0)
    out["reduce_on_0"] = r.item() if rank == 0 else None
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
    else:
        got = torch.zeros(1)
        out["recv_from"] = dist.recv(got, src=0)
        out["recv"] = got.item()
    group = dist.new_group([0, 1])
    out["global_rank_of_1"] = dist.get_global_rank(group, 1)
    out["all_ranks"] = dist.get_all_ranks_from_group(group)
    out["world_group_size"] = dist.get_world_size(dist.get_world_group())
    ar = torch.ones(3)
    dist.all_reduce(ar, group=group)
    out["all_reduce_group"] = ar.tolist()
    objs = [{"rank": rank}]
    dist.broadcast_object_list(objs, src=1)
    out["object"] = objs[0]
    dist.barrier()
    out["counted"] = sorted(dist.comms_logger.snapshot())
    dist.configure(enabled=True, prof_all=True)
    dist.log_summary()
    return out


def test_deepspeed_comm_api_on_two_ranks():
    r0, r1 = run_ranks(_collectives, 2, timeout=120)
    assert r0["all_gather"] == r1["all_gather"] == [[1.0, 1.0], [2.0, 2.0]]
    assert r0["all_gather_into_tensor"] == [1.0, 1.0, 2.0, 2.0]
    assert r0["reduce_scatter_tensor"] == [0.0, 3.0] and r1["reduce_scatter_tensor"] == [6.0, 9.0]
    assert r0["all_to_all_single"] == [0.0, 1.0, 10.0, 11.0] and r1["all_to_all_single"] == [2.0, 3.0, 12.0, 13.0]
    assert r0["all_to_all_uneven"] == [0.0, 10.0, 11.0] and r1["all_to_all_uneven"] == [1.0, 2.0, 3.0, 12.0, 13.0]
    assert r0["broadcast"] == r1["broadcast"] == 1.0
    assert r0["reduce_on_0"] == 3.0
    assert r1["recv"] == 42.0 and r1["recv_from"] == 0
    assert r0["global_rank_of_1"] == 1 and r0["all_ranks"] == [0, 1] and r0["world_group_size"] == 2
    assert r0["all_reduce_group"] == [2.0, 2.0, 2.0]
    assert r0["object"] == r1["object"] == {"rank": 1}
    for name in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
                 "reduce", "all_reduce", "broadcast_object_list", "barrier"):
        assert name in r0["counted"], name
    assert "send" in r0["counted"] and "recv" in r1["counted"]


def _init_with_rank_args(port: int) -> tuple:
    import os

    import dsrun.comm as dist
    rank = int(os.environ.pop("RANK"))
    world = int(os.environ.pop("WORLD_SIZE"))
    os.environ.pop("MASTER_PORT")
    dist.init_distributed(dist_backend="gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                          world_size=world, verbose=False)
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def test_init_distributed_with_deepspeeds_arguments():
    from tests.dist_helpers import free_port
    port = free_port()
    assert run_ranks(_init_with_rank_args, 2, port, timeout=120) == [(0, 2.0), (1, 2.0)]


def test_init_distributed_rejects_other_init_methods():
    import pytest

    import dsrun.comm as dist
    with pytest.raises(ValueError, match="env:// or tcp://HOST:PORT"):
        dist.init_distributed(init_method="file:///tmp/x", dist_init_required=True)

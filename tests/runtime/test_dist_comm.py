"""Rank environment validation, bucket planning and unused parameters across ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dsrun
from dsrun.runtime.strategy.data_parallel import plan_buckets
from dsrun.runtime.distributed.dist import DistributedSetupError, init_distributed
from tests.dist_helpers import run_ranks


@pytest.mark.parametrize("env,match", [
    ({"RANK": "0"}, "WORLD_SIZE is not"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "0 <= RANK < WORLD_SIZE"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
])
def test_bad_rank_environment(monkeypatch, env: dict, match: str) -> None:
    """Inconsistent variables fail before any process group is created."""
    if dist.is_initialized():  # a group left by an earlier in-process test would be reused as is
        dist.destroy_process_group()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistributedSetupError, match=match):
        init_distributed()


def test_plan_buckets() -> None:
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 10, 2)]
    ps.append(torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)))
    assert [[p.numel() for p in b] for b in plan_buckets(ps, 8)] == [[3, 4], [10], [2], [1]]
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        plan_buckets(ps, 0)


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 4)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)])

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](self.body(x))


def _unused_rank() -> dict:
    """Rank r uses only head r: the other head has no gradient on this rank."""
    topo = dsrun.init_distributed()
    engine, *_ = dsrun.initialize(model=_TwoHeads(), config={
        "train_batch_size": 4, "gradient_clipping": 0.0, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"reduce_bucket_size": 5}})
    x = torch.full((2, 4), float(topo.rank + 1))
    engine.backward(engine(x, topo.rank).sum())
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    engine.step()
    return {"grads": grads, "calls": engine.comm_stats()["all_reduce"].calls}


def test_unused_parameters_differ_per_rank() -> None:
    """Gradients are averaged even when each rank leaves a different head unused."""
    results = run_ranks(_unused_rank, 2, timeout=120)
    model = _TwoHeads()
    for r in range(2):
        model(torch.full((2, 4), float(r + 1)), r).sum().backward()
    for res in results:
        for n, p in model.named_parameters():
            torch.testing.assert_close(res["grads"][n], p.grad / 2)
    # 4 x 1 + 1 weights/bias per head, 16 + 4 body: several buckets, same count on both ranks.
    assert results[0]["calls"] == results[1]["calls"] > 1

"""The pipeline's point-to-point traffic goes over shared-memory channels
between ranks of one node (p2p.py [Note: the transport of a stage link]),
as do the data groups' all-reduces (comm/collectives.py [Note: choosing the
transport]), and over gloo with DSRUN_SHM_COMM=0 or across nodes; training matches the
one-process reference either way."""
from __future__ import annotations

import pytest

from tests.dist_helpers import as_nodes, run_ranks
from tests.parallel.test_pipe_engine import _check, _train_pipeline, _train_reference


def _train_and_count(ranks_per_node: int | None, schedule: str, virtual: int) -> dict:
    from dsrun.runtime.comm.logger import comms_logger
    if ranks_per_node is not None:
        as_nodes(ranks_per_node)
    comms_logger.reset()
    result = _train_pipeline(2, 4, schedule, 0, False, virtual, True)
    stats = comms_logger.snapshot()
    result["transports"] = {op: stats[op].transports for op in ("isend", "irecv") if op in stats}
    result["all_reduce"] = stats["all_reduce"].transports if "all_reduce" in stats else {}
    return result


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2)])
def test_stages_on_one_node_use_shared_memory(schedule, virtual):
    results = run_ranks(_train_and_count, 4, None, schedule, virtual)
    _check(results, _train_reference(2, 4, True), rtol=1e-4, atol=1e-5)
    for r in results:
        assert set(r["transports"]) == {"isend", "irecv"}, r["transports"]
        assert all(set(t) == {"shm"} for t in r["transports"].values()), r["transports"]
        # The data groups inside the pipeline (ranks 0, 2 and 1, 3) reduce over shared memory too.
        assert set(r["all_reduce"]) == {"shm"}, r["all_reduce"]


def test_gloo_without_shm_or_across_nodes(monkeypatch):
    monkeypatch.setenv("DSRUN_SHM_COMM", "0")
    for r in run_ranks(_train_and_count, 2, None, "1f1b", 1):
        assert all(set(t) == {"torch"} for t in r["transports"].values()), r["transports"]
    monkeypatch.delenv("DSRUN_SHM_COMM")
    # 2 "nodes" of one rank each: stage 0 and stage 1 are on different nodes.
    for r in run_ranks(_train_and_count, 2, 1, "1f1b", 1):
        assert all(set(t) == {"torch"} for t in r["transports"].values()), r["transports"]
        assert set(r["all_reduce"]) <= {"torch"}, r["all_reduce"]


def _messages():
    """What rank 0 sends, in order: shapes repeated, changed (a tuple of
    mixed dtypes), changed back, a 0-dim tensor; each with the number of
    messages it should take ([Note: tensor metadata per micro-batch]: one
    when the shapes are the last ones, else mark + header + one per tensor)."""
    import torch
    g = torch.Generator().manual_seed(7)
    first = lambda: (torch.randn(2, 3, generator=g).requires_grad_(),)  # noqa: E731
    mixed = lambda: (torch.randn(2, 5, generator=g).requires_grad_(), torch.randint(0, 9, (4,), generator=g),  # noqa: E731
                     torch.rand(3, generator=g) > 0.5, torch.randn(2, 2, generator=g).bfloat16().requires_grad_())
    scalar = lambda: (torch.randn((), generator=g).requires_grad_(),)  # noqa: E731
    return [(first(), 3), (first(), 1), (first(), 1), (mixed(), 6), (mixed(), 1), (first(), 3), (scalar(), 3),
            (scalar(), 1)]


def _exchange() -> dict:
    import torch

    from dsrun.runtime.comm.logger import comms_logger
    from dsrun.runtime.distributed.dist import init_distributed
    from dsrun.runtime.parallel.pipe.p2p import StageLink
    init_distributed()
    link = StageLink(torch.device("cpu"))
    comms_logger.reset()
    rank = torch.distributed.get_rank()
    got, sent = [], []
    for value, _ in _messages():
        if rank == 0:
            before = comms_logger.snapshot().get("isend")
            link.send_activations(value, 1)
            sent.append(comms_logger.snapshot()["isend"].calls - (before.calls if before else 0))
        else:
            got.append([(t.detach().clone(), t.requires_grad) for t in link.recv_activations(0)])
    link.wait_sends()
    torch.distributed.barrier()
    link.close()
    return {"got": got, "sent": sent}


@pytest.mark.parametrize("shm", [True, False])
def test_activations_arrive_whole_in_one_message_while_shapes_hold(monkeypatch, shm):
    """Activations of unchanged shapes travel as one packed message, changed
    ones are announced; what arrives equals what was sent (values, dtypes,
    shapes, requires_grad for floating-point tensors), over shared memory
    and over gloo."""
    import torch
    if not shm:
        monkeypatch.setenv("DSRUN_SHM_COMM", "0")
    sender, receiver = run_ranks(_exchange, 2)
    expected = _messages()
    assert sender["sent"] == [n for _, n in expected]
    for got, (value, _) in zip(receiver["got"], expected):
        assert len(got) == len(value)
        for (t, grad), want in zip(got, value):
            assert t.dtype == want.dtype and t.shape == want.shape
            assert torch.equal(t, want.detach())
            assert grad == want.requires_grad

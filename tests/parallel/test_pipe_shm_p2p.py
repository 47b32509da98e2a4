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

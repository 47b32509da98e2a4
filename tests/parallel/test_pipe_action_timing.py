"""`PipelineEngine.action_timing`: the per-action table of a step counts
every action of the rank's schedule, splits each action's time into parts
that add up, and changes nothing about training (the losses equal those of
a step without it)."""
from __future__ import annotations

import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_pipe_engine import _config, _layers, _micro_batch

MICRO_BATCHES = 4


def _train(timing_steps: tuple[int, ...]) -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    module = PipelineModule(_layers(), num_stages=2, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform")
    engine, *_ = dsrun.initialize(model=module, config=_config(2, 1, MICRO_BATCHES, "1f1b", 0, False, 1))
    losses, tables = [], []
    for step in range(3):
        engine.action_timing = step in timing_steps
        losses.append(float(engine.train_batch(iter([_micro_batch(step, 0, j) for j in range(MICRO_BATCHES)]))))
        tables.append(engine.last_action_times)
    return {"stage": engine.stage_id, "losses": losses, "tables": tables}


def test_action_table_counts_every_action_and_leaves_training_unchanged():
    timed = run_ranks(_train, 2, (1,))
    untimed = run_ranks(_train, 2, ())
    for with_timing, without in zip(timed, untimed):
        assert with_timing["losses"] == without["losses"]
        assert without["tables"] == [{}, {}, {}]  # off: no table
    first, last = sorted(timed, key=lambda r: r["stage"])
    assert first["tables"][0] == {} and first["tables"][2] == first["tables"][1]  # only step 1 timed; kept after
    m = MICRO_BATCHES
    expected = {0: {"LoadMicroBatch": m, "Forward": m, "SendActivation": m, "RecvGrad": m, "Backward": m,
                    "ReduceTiedGrads": 1, "ReduceGrads": 1, "OptimizerStep": 1},
                1: {"LoadMicroBatch": m, "RecvActivation": m, "Forward": m, "Backward": m, "SendGrad": m,
                    "ReduceTiedGrads": 1, "ReduceGrads": 1, "OptimizerStep": 1}}
    for rank in (first, last):
        table = rank["tables"][1]
        assert {kind: row["count"] for kind, row in table.items()} == expected[rank["stage"]]
        for kind, row in table.items():
            assert 0.0 <= row["wait_s"] <= row["total_s"], kind
            assert 0.0 <= row["compute_s"] <= row["total_s"], kind
            assert row["wait_s"] + row["compute_s"] <= row["total_s"] + 1e-9, kind
            assert row["cpu_s"] >= 0.0, kind
        assert table["Forward"]["compute_s"] > 0.0 and table["Backward"]["compute_s"] > 0.0
        assert table["Backward"]["cpu_s"] > 0.0  # autograd's work runs on the executor's thread
        waits = "RecvGrad" if rank["stage"] == 0 else "RecvActivation"
        assert table[waits]["wait_s"] > 0.0  # a receive is counted as waiting on the neighbour
    assert torch.isfinite(torch.tensor(first["losses"])).all()

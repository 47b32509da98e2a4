"""The bubble arithmetic of bench/pipeline/pipeline_bubble.py: per-rank
"own" and "span" bubbles from engine.last_bubble readings, and the
simulated theory it prints beside them."""
from __future__ import annotations

import pytest

from bench.pipeline.pipeline_bubble import parse_run, replay_costs, replay_row, step_bubbles, theory_row


def _rank(stage: int, data: int, wait: float, schedule: float, cpu: float) -> dict:
    return {"stage": stage, "data": data, "steps": [{"wait_s": wait, "schedule_s": schedule, "cpu_s": cpu}]}


def test_step_bubbles_own_and_span_per_pipeline():
    # two pipelines (data 0 and 1) of two stages; pipeline 1 is twice as slow
    ranks = [_rank(0, 0, 1.0, 4.0, 3.0), _rank(1, 0, 0.5, 3.0, 2.5),
             _rank(0, 1, 2.0, 8.0, 3.0), _rank(1, 1, 1.0, 6.0, 5.0)]
    got = {(b["stage"], b["data"]): b for b in step_bubbles(ranks, 0)}
    assert got[(0, 0)]["own"] == pytest.approx(0.25)
    assert got[(1, 0)]["own"] == pytest.approx(0.5 / 3.0)
    # span: idle over the slowest schedule of the same pipeline, not of the job
    assert got[(1, 0)]["span"] == pytest.approx(1 - 2.5 / 4.0)
    assert got[(1, 1)]["span"] == pytest.approx(1 - 5.0 / 8.0)
    assert got[(0, 1)]["cpu_share"] == pytest.approx(3.0 / 6.0)
    assert got[(0, 1)]["busy_s"] == pytest.approx(6.0) and got[(0, 1)]["wait_s"] == pytest.approx(2.0)


def test_step_bubbles_refuses_a_step_without_a_schedule():
    with pytest.raises(ValueError, match="not a pipeline step"):
        step_bubbles([_rank(0, 0, 0.0, 0.0, 1.0)], 0)


@pytest.mark.parametrize("name,m", [("p4-1f1b", 8), ("p2-1f1b", 4), ("p4-interleaved", 8), ("p4-zb-h1", 8)])
def test_theory_row_simulated_span_is_the_papers_bubble(name, m):
    row = theory_row(parse_run(name, 2), m)
    assert row["sim span"] == pytest.approx(row["paper"])
    assert row["sim own"] <= row["sim span"] + 1e-12  # a rank's own span ends at or before the makespan


def test_theory_row_zero_bubble_step_against_1f1b():
    # F = B = W: 1F1B's makespan is (m + p - 1) * 3 = 33, ZB-H1's m * 3 + (p - 1) * (F + B - W) = 27
    row = theory_row(parse_run("p4-zb-h1", 2), 8)
    assert row["sim step / 1f1b"] == pytest.approx(27 / 33)
    assert theory_row(parse_run("p4-1f1b", 2), 8)["sim step / 1f1b"] == pytest.approx(1.0)


def _timed_launch(stages: int, passes: dict[str, float], data: int = 2) -> list[dict]:
    """One launch's rank results whose action tables ran 4 of each pass at `passes` CPU seconds each."""
    actions = {kind: {"count": 4, "cpu_s": 4 * cost} for kind, cost in passes.items()}
    return [{"stage": st, "data": d, "steps": [{"actions": actions}] * 2} for st in range(stages) for d in range(data)]


def test_replay_of_measured_costs_gives_the_schedules_makespan():
    # F = 1 ms, B = 2 ms (BI = BW = 1 ms): 1F1B (m + p - 1)(F + B), ZB-H1 m(F + B) + (p - 1)(F + BI - BW)
    one_f_one_b = replay_row(parse_run("p2-1f1b", 2), 4,
                             replay_costs([_timed_launch(2, {"Forward": 1e-3, "Backward": 2e-3})], 2))
    assert one_f_one_b["step"] == pytest.approx(15e-3)
    assert one_f_one_b["bubble"] == pytest.approx(0.2)  # (p - 1) / (m + p - 1)
    zero_bubble = replay_row(parse_run("p2-zb-h1", 2), 4, replay_costs(
        [_timed_launch(2, {"Forward": 1e-3, "BackwardInput": 1e-3, "BackwardWeight": 1e-3})], 2))
    assert zero_bubble["step"] == pytest.approx(13e-3)
    # this machine's shape: a pipeline of 2 stages gets 1 of the 2 cores (2 replicas), so all its work in a row
    assert one_f_one_b["step on cores"] == pytest.approx(24e-3)
    assert zero_bubble["step on cores"] == pytest.approx(24e-3)
    # F = BI = BW: the paper's bubble with the measured passes is its F = B = W figure
    assert zero_bubble["paper measured"] == pytest.approx(theory_row(parse_run("p2-zb-h1", 2), 4)["paper"])

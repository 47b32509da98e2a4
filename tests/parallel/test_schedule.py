"""Pipeline schedules as data (dsrun/runtime/parallel/pipe/schedule.py) and
their simulator (simulate.py): every pass once on the right rank, sends and
receives matched one to one, no deadlock, the activation-memory bounds, and
simulated bubbles equal to the papers' formulas."""
from collections import Counter

import pytest

from dsrun.runtime.parallel.pipe.schedule import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    build_schedule,
    inference_schedule,
    peer,
    theoretical_bubble,
)
from dsrun.runtime.parallel.pipe.simulate import ScheduleError, simulate, simulate_on_cores


def _cases():
    """(name, p, m, v) for every schedule: p in 1..4, m in 1..8; interleaved
    only where valid (p >= 2, m % p == 0) with v in 2, 3."""
    for p in range(1, 5):
        for m in range(1, 9):
            yield "1f1b", p, m, 1
            yield "zb-h1", p, m, 1
            if p >= 2 and m % p == 0:
                yield "interleaved", p, m, 2
                yield "interleaved", p, m, 3


CASES = list(_cases())


def _all_ranks(name, p, m, v=1):
    return [build_schedule(name, p, rank, m, v) for rank in range(p)]


def _compute_order(actions):
    """Compact compute order: 'F0', 'B0', 'I0' (B pass), 'W0', with ':c' for chunk c > 0."""
    letters = {Forward: "F", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}
    return [f"{letters[type(a)]}{a.micro_batch}" + (f":{a.chunk}" if a.chunk else "")
            for a in actions if type(a) in letters]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_pass_runs_once_on_its_rank(name, p, m, v):
    passes = Counter()
    loads = Counter()
    for rank, actions in enumerate(_all_ranks(name, p, m, v)):
        assert actions[-3:] == [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        assert sum(isinstance(a, (ReduceTiedGrads, ReduceGrads, OptimizerStep)) for a in actions) == 3
        for a in actions:
            stage = a.chunk * p + rank if hasattr(a, "chunk") else None
            if isinstance(a, (Forward, Backward, BackwardInput, BackwardWeight)):
                passes[type(a), a.micro_batch, stage] += 1
            elif isinstance(a, LoadMicroBatch):
                loads[a.micro_batch, stage] += 1
    stages = range(p * v)
    kinds = (Forward, BackwardInput, BackwardWeight) if name == "zb-h1" else (Forward, Backward)
    assert passes == Counter({(k, mb, s): 1 for k in kinds for mb in range(m) for s in stages})
    # Inputs on the first stage, labels on the last (one load when they coincide).
    assert loads == Counter({(mb, s): 1 for mb in range(m) for s in {0, p * v - 1}})


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_sends_and_receives_match_one_to_one(name, p, m, v):
    sends, recvs = Counter(), Counter()
    recv_of = {SendActivation: RecvActivation, SendGrad: RecvGrad}
    for rank, actions in enumerate(_all_ranks(name, p, m, v)):
        for a in actions:
            if type(a) in recv_of:
                sends[(recv_of[type(a)], a.micro_batch) + peer(a, p, rank, v)] += 1
            elif isinstance(a, (RecvActivation, RecvGrad)):
                recvs[type(a), a.micro_batch, rank, a.chunk] += 1
    assert sends == recvs
    assert set(sends.values()) <= {1}
    # One activation and one gradient per micro-batch per stage boundary.
    assert sum(sends.values()) == 2 * m * (p * v - 1)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_simulated_bubble_and_memory_match_the_papers(name, p, m, v):
    result = simulate(_all_ranks(name, p, m, v), virtual_stages=v)
    peaks = [r.peak_in_flight for r in result.ranks]
    busy = {r.busy for r in result.ranks}
    assert len(busy) == 1 and busy.pop() == 3 * m * v  # F + B + W per pass, one unit each
    if name == "1f1b":
        assert peaks == [min(p - stage, m) for stage in range(p)]
    if name == "zb-h1":
        # Qi et al. section 2.1: W of micro-batch i waits for the B of i + stage,
        # so every stage holds as many as 1F1B's first stage and no more.
        assert peaks == [min(p, m)] * p
    if name != "zb-h1" or m >= p:
        assert result.bubble_fraction == pytest.approx(theoretical_bubble(name, p, m, v), abs=1e-12)
    if name == "zb-h1" and p >= 2:
        assert result.bubble_fraction < simulate(_all_ranks("1f1b", p, m)).bubble_fraction


@pytest.mark.parametrize("costs", [(1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.0, 2.0, 0.5)])
def test_bubbles_with_unequal_costs(costs):
    for p in (2, 4):
        for m in (p, p + 3, 2 * p):
            for name, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
                if name == "interleaved" and m % p:
                    continue
                measured = simulate(_all_ranks(name, p, m, v), *costs, virtual_stages=v).bubble_fraction
                expected = theoretical_bubble(name, p, m, v, *costs)
                assert measured == pytest.approx(expected, abs=1e-12), (name, p, m)


def test_zb_h1_formula_refuses_costs_it_does_not_cover():
    with pytest.raises(ValueError, match="num_micro_batches >= num_stages"):
        theoretical_bubble("zb-h1", 4, 3)
    with pytest.raises(ValueError, match="backward_weight_cost <= min"):
        theoretical_bubble("zb-h1", 4, 8, 1, 1.0, 1.0, 1.5)


def test_orders_follow_deepspeed_megatron_and_zero_bubble():
    # DeepSpeed TrainSchedule, stage 1 of 4: p - stage - 1 = 2 warm-up forwards.
    assert _compute_order(build_schedule("1f1b", 4, 1, 6)) == [
        "F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "B4", "B5"]
    # Megatron interleaved, rank 0 of 2, 2 chunks: (p - 1) * 2 + (v - 1) * p = 4 warm-up forwards.
    assert _compute_order(build_schedule("interleaved", 2, 0, 4, 2)) == [
        "F0", "F1", "F0:1", "F1:1", "F2", "B0:1", "F3", "B1:1", "F2:1", "B0", "F3:1", "B1",
        "B2:1", "B3:1", "B2", "B3"]
    # ZB-H1, last of 2 stages: its W passes lag its B passes by one micro-batch.
    assert _compute_order(build_schedule("zb-h1", 2, 1, 3)) == [
        "F0", "I0", "F1", "I1", "W0", "F2", "I2", "W1", "W2"]


def test_communication_wraps_each_compute():
    actions = build_schedule("zb-h1", 3, 1, 1)
    assert actions[:6] == [RecvActivation(0), Forward(0), SendActivation(0),
                           RecvGrad(0), BackwardInput(0), SendGrad(0)]
    assert actions[6] == BackwardWeight(0)  # after SendGrad: the previous stage need not wait for W


def test_peer_maps_virtual_stages_across_ranks():
    assert peer(SendActivation(0, 0), 4, 3, 2) == (0, 1)  # stage 3 -> stage 4
    assert peer(RecvActivation(0, 1), 4, 0, 2) == (3, 0)
    assert peer(SendGrad(5, 1), 4, 0, 2) == (3, 0)
    assert peer(RecvGrad(5, 0), 4, 2, 2) == (3, 0)
    with pytest.raises(ValueError, match="first pipeline stage"):
        peer(SendGrad(0, 0), 4, 0, 2)
    with pytest.raises(ValueError, match="last pipeline stage"):
        peer(SendActivation(0, 1), 4, 3, 2)
    with pytest.raises(TypeError, match="Send\\*/Recv\\*"):
        peer(Forward(0), 4, 0)


def test_inference_schedule_runs_forwards_only():
    p, m = 3, 5
    schedules = [inference_schedule(p, rank, m) for rank in range(p)]
    assert _compute_order(schedules[1]) == [f"F{mb}" for mb in range(m)]
    assert schedules[0][:3] == [LoadMicroBatch(0), Forward(0), SendActivation(0)]
    assert schedules[2][:3] == [LoadMicroBatch(0), RecvActivation(0), Forward(0)]
    result = simulate(schedules)
    assert result.makespan == m + p - 1
    assert [r.peak_in_flight for r in result.ranks] == [0] * p
    # Each of the p - 1 hops of the last micro-batch adds the latency once.
    assert simulate(schedules, p2p_latency=0.5).makespan == m + p - 1 + (p - 1) * 0.5


@pytest.mark.parametrize("call,match", [
    (lambda: build_schedule("gpipe", 2, 0, 4), "1f1b, interleaved, zb-h1"),
    (lambda: build_schedule("interleaved", 4, 0, 6, 2), "multiple of num_stages"),
    (lambda: build_schedule("interleaved", 4, 0, 8, 1), "virtual_stages >= 2"),
    (lambda: build_schedule("interleaved", 1, 0, 4, 2), "num_stages >= 2"),
    (lambda: build_schedule("1f1b", 4, 0, 8, 2), "use 'interleaved'"),
    (lambda: build_schedule("1f1b", 4, 4, 8), "stage_id must be in 0..3"),
    (lambda: build_schedule("zb-h1", 4, 0, 0), "num_micro_batches must be >= 1"),
    (lambda: theoretical_bubble("gpipe", 4, 8), "1f1b, interleaved, zb-h1"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _move_before(actions, a, before):
    out = [x for x in actions if x != a]
    out.insert(out.index(before), a)
    return out


def test_planted_bad_schedules_make_simulate_raise():
    good = _all_ranks("1f1b", 3, 4)
    simulate(good)

    # Backward swapped with its Forward on the last stage.
    bad = list(good)
    i, j = good[2].index(Forward(0)), good[2].index(Backward(0))
    bad[2] = list(good[2])
    bad[2][i], bad[2][j] = bad[2][j], bad[2][i]
    with pytest.raises(ScheduleError, match="runs Backward.* before Forward"):
        simulate(bad)

    # Rank 1 waits for micro-batch 1's gradient before sending its activation,
    # which rank 2 needs to produce that gradient.
    bad = list(good)
    bad[1] = _move_before(good[1], RecvGrad(1), RecvActivation(1))
    deadlock = "deadlock: .*rank 1 waits at RecvGrad.*rank 2 waits at RecvActivation"
    with pytest.raises(ScheduleError, match=deadlock):
        simulate(bad)

    # A receive nobody sends: the deadlock names the missing send.
    bad = list(good)
    bad[0] = [a for a in good[0] if a != SendActivation(3)]
    with pytest.raises(ScheduleError, match="never sends it"):
        simulate(bad)

    # A backward without its gradient.
    bad = list(good)
    bad[1] = [a for a in good[1] if a != RecvGrad(3)]
    with pytest.raises(ScheduleError, match="before RecvGrad"):
        simulate(bad)

    # A backward missing altogether: activations held at the optimizer step.
    bad = list(good)
    bad[0] = [a for a in good[0] if a not in (RecvGrad(3), Backward(3))]
    with pytest.raises(ScheduleError, match="still held"):
        simulate(bad)

    # W before its B on a zero bubble schedule.
    zb = _all_ranks("zb-h1", 2, 2)
    zb[1] = _move_before(zb[1], BackwardWeight(0), BackwardInput(0))
    with pytest.raises(ScheduleError, match="before BackwardInput"):
        simulate(zb)


def test_send_nobody_receives_makes_simulate_raise():
    schedules = [inference_schedule(2, rank, 2) for rank in range(2)]
    schedules[1] = [a for a in schedules[1] if a.micro_batch != 1]
    with pytest.raises(ScheduleError, match="SendActivation.*never received"):
        simulate(schedules)


def test_simulate_with_measured_costs_per_rank():
    """rank_costs: a last stage twice as slow stretches 1F1B by its own
    passes; the same costs as the uniform ones give the same step."""
    schedules = _all_ranks("1f1b", 2, 2)
    uniform = {Forward: 1.0, BackwardInput: 1.0, BackwardWeight: 1.0, Backward: 2.0}
    assert simulate(schedules, rank_costs=[uniform, uniform]) == simulate(schedules)
    # rank 0: F0 [0,1] F1 [1,2]; rank 1: F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13]; rank 0: B0 [7,9] B1 [13,15]
    result = simulate(schedules, rank_costs=[{Forward: 1.0, Backward: 2.0}, {Forward: 2.0, Backward: 4.0}])
    assert result.makespan == 15.0
    assert [r.busy for r in result.ranks] == [6.0, 12.0]
    with pytest.raises(ValueError, match="2 dicts for 3 ranks"):
        simulate(_all_ranks("1f1b", 3, 3), rank_costs=[uniform, uniform])


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_simulate_on_shared_cores(name, v):
    """Ranks sharing cores: a core per rank is `simulate`'s step, one core
    runs all the work back to back, and 4 ranks on 2 cores (F = 1, B = 2,
    m = 8) take 1F1B 51 and ZB-H1 49 units: at most 2 of 96 units of
    bubble are left to remove, the 48 of the work split over 2 cores being
    the floor."""
    schedules = _all_ranks(name, 4, 8, v)
    costs = [{Forward: 1.0 / v, Backward: 2.0 / v, BackwardInput: 1.0, BackwardWeight: 1.0}] * 4
    alone = simulate(schedules, virtual_stages=v, rank_costs=costs).makespan
    assert simulate_on_cores(schedules, costs, 4, v) == pytest.approx(alone)
    assert simulate_on_cores(schedules, costs, 1, v) == pytest.approx(96.0)
    assert simulate_on_cores(schedules, costs, 2, v) == pytest.approx({"1f1b": 51.0, "zb-h1": 49.0,
                                                                       "interleaved": 48.75}[name])
    with pytest.raises(ValueError, match="cores must be > 0"):
        simulate_on_cores(schedules, costs, 0, v)

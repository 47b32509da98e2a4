"""A discrete-event run of pipeline schedules on a cost model: per-rank busy
and idle time, makespan and peak activation memory, and a check that the
schedules are consistent (no deadlock, every send received, no compute before
its inputs). The semantics are those of [Note: the action contract] in
``schedule.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsrun.runtime.parallel.pipe.schedule import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    LoadMicroBatch,
    MicroBatchAction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    peer,
)


class ScheduleError(ValueError):
    """The schedules cannot run: a deadlock, an unmatched send or receive, or
    an action before what it depends on."""


@dataclass(frozen=True)
class RankTimeline:
    """What one rank did in a simulated step (times in cost units).

    ``busy``: time spent computing. ``finish``: when its last action ended.
    ``idle``: makespan of the whole pipeline minus ``busy`` (waiting on
    neighbours, including after its own last action until the slowest rank
    ends). ``peak_in_flight``: the most micro-batches whose activations it
    held at once.
    """
    busy: float
    idle: float
    finish: float
    peak_in_flight: int


@dataclass(frozen=True)
class SimulationResult:
    """``ranks``: one RankTimeline per rank. ``makespan``: when the last rank
    finished."""
    ranks: list[RankTimeline]
    makespan: float

    @property
    def bubble_fraction(self) -> float:
        """Idle time over makespan, averaged over the ranks (0 for an empty step)."""
        if self.makespan == 0:
            return 0.0
        return sum(r.idle for r in self.ranks) / (len(self.ranks) * self.makespan)


_SEND_OF = {RecvActivation: SendActivation, RecvGrad: SendGrad}


def simulate(schedules: list[list[Action]], forward_cost: float = 1.0,
             backward_input_cost: float = 1.0, backward_weight_cost: float = 1.0,
             virtual_stages: int = 1, p2p_latency: float = 0.0,
             rank_costs: list[dict[type, float]] | None = None) -> SimulationResult:
    """Run one step of ``schedules`` (``schedules[r]`` is rank r's list, as
    from ``build_schedule``) with the given costs per chunk pass.

    A ``Backward`` costs ``backward_input_cost + backward_weight_cost``;
    loads, sends, receives and the step-end actions cost nothing, and a
    received tensor is ready ``p2p_latency`` after its send was issued.
    ``rank_costs`` (one dict per rank: action class -> cost of one such
    action on that rank, e.g. measured) replaces those costs: an action
    class missing from a rank's dict costs nothing there. A cost of a
    receive is spent once its message has arrived (the copy out), not
    while waiting.

    Activation memory: a micro-batch counts as in flight on a rank from its
    ``Forward`` until the ``Backward`` or ``BackwardWeight`` that frees it.
    For zero bubble schedules that is an upper bound: after
    ``BackwardInput`` only what the weight gradient needs is still held. A
    rank whose list has no backward at all (evaluation) holds nothing.

    Raises ScheduleError on a deadlock (receives that can never be matched,
    naming each blocked rank and action), a send nobody receives, an action
    run twice, or a dependency violation: a Forward without its input
    (receive, or load on the first stage) or labels (load on the last), a
    Send before the compute that produces it, a B/W or Backward before its
    Forward and gradient, a W before its B, a Recv/Send with no neighbour,
    or OptimizerStep before ReduceTiedGrads/ReduceGrads or with activations
    still held.
    """
    p = len(schedules)
    if p == 0:
        raise ValueError("simulate() needs one schedule per rank, got none")
    if rank_costs is not None and len(rank_costs) != p:
        raise ValueError(f"simulate(): rank_costs has {len(rank_costs)} dicts for {p} ranks")
    uniform = {Forward: forward_cost, BackwardInput: backward_input_cost,
               BackwardWeight: backward_weight_cost,
               Backward: backward_input_cost + backward_weight_cost}
    costs = rank_costs if rank_costs is not None else [uniform] * p
    ranks = [_Rank(rank, p, virtual_stages, actions) for rank, actions in enumerate(schedules)]
    sent: dict[tuple, float] = {}  # (send type, micro_batch, peer rank, peer chunk) -> issue time
    received: set[tuple] = set()
    progress = True
    while progress:
        progress = False
        for r in ranks:
            while r.pc < len(r.actions):
                action = r.actions[r.pc]
                if type(action) in _SEND_OF:
                    key = (_SEND_OF[type(action)], action.micro_batch, r.rank, action.chunk)
                    if key not in sent:
                        break
                    r.clock = max(r.clock, sent[key] + p2p_latency)
                    received.add(key)
                r.run(action, costs[r.rank], sent)
                progress = True
    blocked = [r for r in ranks if r.pc < len(r.actions)]
    if blocked:
        raise ScheduleError("deadlock: " + "; ".join(_why_blocked(r, ranks) for r in blocked))
    unreceived = set(sent) - received
    if unreceived:
        kind, mb, rank, chunk = min(unreceived, key=repr)
        raise ScheduleError(f"{kind.__name__}(micro_batch={mb}) to rank {rank} chunk {chunk} is never "
                            f"received ({len(unreceived)} unmatched sends)")
    makespan = max(r.clock for r in ranks)
    return SimulationResult(
        ranks=[RankTimeline(busy=r.busy, idle=makespan - r.busy, finish=r.clock,
                            peak_in_flight=r.peak) for r in ranks],
        makespan=makespan)


class _Rank:
    """One rank's progress through its list: clock, what it has done, memory."""

    def __init__(self, rank: int, p: int, v: int, actions: list[Action]):
        self.rank, self.p, self.v, self.actions = rank, p, v, actions
        self.pc = 0
        self.clock = 0.0
        self.busy = 0.0
        self.done: set[tuple] = set()  # (type, micro_batch, chunk) or (type,) for step-end actions
        self.holds = any(isinstance(a, (Backward, BackwardInput)) for a in actions)
        self.in_flight = 0
        self.peak = 0

    def run(self, action: Action, costs: dict, sent: dict) -> None:
        """Check ``action``'s dependencies, then run it."""
        key = _key(action)
        if key in self.done:
            raise ScheduleError(f"rank {self.rank} runs {action!r} twice")
        for need in self._needs(action):
            if need not in self.done:
                raise ScheduleError(f"rank {self.rank} runs {action!r} before {need[0].__name__}"
                                    f"{need[1:] if len(need) > 1 else ''}")
        self.done.add(key)
        self.pc += 1
        cost = costs.get(type(action), 0.0)
        self.clock += cost
        self.busy += cost
        if isinstance(action, (SendActivation, SendGrad)):
            to_rank, to_chunk = self._peer(action)
            sent[(type(action), action.micro_batch, to_rank, to_chunk)] = self.clock
        elif isinstance(action, (RecvActivation, RecvGrad)):
            self._peer(action)
        if self.holds and isinstance(action, Forward):
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        elif self.holds and isinstance(action, (Backward, BackwardWeight)):
            self.in_flight -= 1

    def _peer(self, action: MicroBatchAction) -> tuple[int, int]:
        try:
            return peer(action, self.p, self.rank, self.v)
        except ValueError as err:
            raise ScheduleError(str(err)) from None

    def _needs(self, action: Action) -> list[tuple]:
        """What must have run on this rank before ``action``."""
        if isinstance(action, ReduceGrads):
            return [(ReduceTiedGrads,)]
        if isinstance(action, OptimizerStep):
            if self.in_flight:
                raise ScheduleError(f"rank {self.rank} reaches OptimizerStep with {self.in_flight} "
                                    f"micro-batches' activations still held (a backward is missing)")
            return [(ReduceTiedGrads,), (ReduceGrads,)]
        if not isinstance(action, MicroBatchAction):
            return []
        mb, chunk = action.micro_batch, action.chunk
        first = self.rank == 0 and chunk == 0
        last = self.rank == self.p - 1 and chunk == self.v - 1
        if isinstance(action, Forward):
            needs = [(RecvActivation, mb, chunk)] if not first else []
            return needs + ([(LoadMicroBatch, mb, chunk)] if first or last else [])
        if isinstance(action, SendActivation):
            return [(Forward, mb, chunk)]
        if isinstance(action, (Backward, BackwardInput)):
            return [(Forward, mb, chunk)] + ([(RecvGrad, mb, chunk)] if not last else [])
        if isinstance(action, BackwardWeight):
            return [(BackwardInput, mb, chunk)]
        if isinstance(action, SendGrad):
            if (BackwardInput, mb, chunk) in self.done:
                return []
            return [(Backward, mb, chunk)]
        return []


def _key(action: Action) -> tuple:
    if isinstance(action, MicroBatchAction):
        return type(action), action.micro_batch, action.chunk
    return (type(action),)


def _why_blocked(r: _Rank, ranks: list[_Rank]) -> str:
    """'rank 1 waits at RecvGrad(...) from rank 2 chunk 0, which never sends
    it' or '..., which is itself blocked at ...'."""
    action = r.actions[r.pc]
    src_rank, src_chunk = r._peer(action)
    send = _SEND_OF[type(action)](action.micro_batch, src_chunk)
    src = ranks[src_rank]
    if send not in src.actions:
        fate = "which never sends it"
    else:
        fate = f"which is blocked at {src.actions[src.pc]!r} before sending it"
    return f"rank {r.rank} waits at {action!r} from rank {src_rank} chunk {src_chunk}, {fate}"


def simulate_on_cores(schedules: list[list[Action]], rank_costs: list[dict[type, float]], cores: float,
                      virtual_stages: int = 1) -> float:
    """The makespan of one step of ``schedules`` when its ranks share
    ``cores`` cores (processor sharing: while n ranks have work, each runs at
    min(1, cores / n) of a core's speed), with the per-rank costs of
    ``simulate``'s ``rank_costs`` (e.g. measured CPU seconds per action);
    messages are free and arrive at once. With ``cores`` >= the number of
    ranks it is ``simulate``'s makespan; with one core, the sum of all costs.

    A model of ranks that outnumber a machine's cores (4 pipeline ranks on 2
    cores): a waiting rank's share goes to the ranks that have work, so a
    bubble only costs time while fewer ranks than cores have work.

    Raises:
        ValueError: cores <= 0, or rank_costs not one dict per rank.
        ScheduleError: as ``simulate`` (a deadlock, an action before its
            dependencies).
    """
    p = len(schedules)
    if cores <= 0 or len(rank_costs) != p:
        raise ValueError(f"simulate_on_cores(): cores must be > 0 (got {cores}) and rank_costs one dict per rank "
                         f"({len(rank_costs)} for {p})")
    ranks = [_Rank(rank, p, virtual_stages, actions) for rank, actions in enumerate(schedules)]
    sent: dict[tuple, float] = {}
    left = [0.0] * p  # work left in the action a rank is running (0: between actions)
    now = 0.0
    while True:
        progress = True
        while progress:  # run every free action up to the next costly one or a receive not yet sent
            progress = False
            for r in ranks:
                while left[r.rank] == 0.0 and r.pc < len(r.actions):
                    action = r.actions[r.pc]
                    if type(action) in _SEND_OF and (_SEND_OF[type(action)], action.micro_batch, r.rank,
                                                     action.chunk) not in sent:
                        break
                    cost = rank_costs[r.rank].get(type(action), 0.0)
                    if cost > 0.0:
                        left[r.rank] = cost
                        break
                    r.run(action, {}, sent)
                    progress = True
        working = [r for r in ranks if left[r.rank] > 0.0]
        if not working:
            break
        speed = min(1.0, cores / len(working))
        step = min(left[r.rank] for r in working) / speed
        now += step
        for r in working:
            left[r.rank] = max(0.0, left[r.rank] - step * speed)
            if left[r.rank] <= 1e-12 * step:  # this action is done: its sends go out now
                left[r.rank] = 0.0
                r.run(r.actions[r.pc], {}, sent)
    blocked = [r for r in ranks if r.pc < len(r.actions)]
    if blocked:
        raise ScheduleError("deadlock: " + "; ".join(_why_blocked(r, ranks) for r in blocked))
    return now

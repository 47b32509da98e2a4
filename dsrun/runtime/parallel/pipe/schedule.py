"""Pipeline schedules as data: the ordered list of actions each rank runs for
one training step (``train_batch``) or one evaluation pass (``eval_batch``).

Nothing here touches ``torch.distributed``; an executor turns the actions into
compute and point-to-point communication, and ``simulate.py`` runs them on a
cost model.

[Note: the action contract]

Words: ``p`` pipeline ranks (``num_stages``), ``m`` micro-batches per step,
``v`` chunks (model pieces) per rank. With interleaving (Narayanan et al.,
SC21, section 2.2; Megatron-LM) rank ``r`` holds chunks ``0..v-1``, and chunk
``c`` is the global virtual stage ``s = c * p + r``; stage ``s + 1`` lives on
rank ``(r + 1) % p``, chunk ``c + (1 if r == p - 1 else 0)``. Without
interleaving ``v = 1`` and every chunk is 0. The first stage is (rank 0,
chunk 0); the last is (rank p-1, chunk v-1). ``peer()`` gives the neighbour.

Every per-micro-batch action carries ``micro_batch`` (0..m-1) and ``chunk``:

- ``LoadMicroBatch``: take the next micro-batch from the data iterator. Only
  on the first stage (inputs) and on the last stage (labels), just before that
  stage's ``Forward``; with one stage, one load gives both.
- ``RecvActivation`` / ``SendActivation``: the stage input from the previous
  stage / the stage output to the next stage.
- ``Forward``: run the chunk on its input; on the last stage also the loss.
- ``RecvGrad`` / ``SendGrad``: the gradient of the stage output from the next
  stage / of the stage input to the previous stage.
- ``Backward``: the full backward of the chunk (input and weight gradients);
  frees the activations ``Forward`` kept.
- ``BackwardInput``: the input gradient only (zero bubble's B pass); the
  activations the weight gradient needs stay held.
- ``BackwardWeight``: the weight gradient only (the W pass) of a micro-batch
  whose ``BackwardInput`` ran; frees what was held.

After the last micro-batch action a training step ends with
``ReduceTiedGrads`` (sum the gradients of modules tied across stages, e.g.
embeddings), ``ReduceGrads`` (data-parallel reduction) and ``OptimizerStep``,
each once, in that order. Evaluation schedules have none of the three.

Semantics the executor must give (``simulate`` assumes exactly these):

1. Each rank runs its own list in order.
2. ``Send*`` does not block: the tensor is buffered and the executor waits on
   the send handle later (at the latest before ``OptimizerStep``).
3. ``Recv*`` blocks until the neighbour has issued the matching ``Send*``.
4. A ``Send*`` with (micro_batch, chunk) on one rank is matched by exactly one
   ``Recv*`` of the same kind and micro_batch on ``peer()``'s rank, with the
   chunk ``peer()`` gives; every send has its receive and vice versa.
5. ``Recv*`` comes just before the compute that needs it and ``Send*`` just
   after the compute that produced it; on zero bubble schedules ``SendGrad``
   follows ``BackwardInput`` (not ``BackwardWeight``), which is what lets the
   previous stage start its backward early.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULE_NAMES = ("1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule (see [Note: the action contract])."""


@dataclass(frozen=True)
class MicroBatchAction(Action):
    """An action on one micro-batch of one chunk.

    ``micro_batch``: index 0..m-1 within the step. ``chunk``: the local chunk
    (virtual stage index on this rank), 0 without interleaving.
    """
    micro_batch: int
    chunk: int = 0


@dataclass(frozen=True)
class LoadMicroBatch(MicroBatchAction):
    """Load inputs (first stage) or labels (last stage) of the micro-batch."""


@dataclass(frozen=True)
class RecvActivation(MicroBatchAction):
    """Receive this chunk's input from the previous stage (blocking)."""


@dataclass(frozen=True)
class Forward(MicroBatchAction):
    """Forward of the chunk; keeps its activations until the backward."""


@dataclass(frozen=True)
class SendActivation(MicroBatchAction):
    """Send this chunk's output to the next stage (non-blocking)."""


@dataclass(frozen=True)
class RecvGrad(MicroBatchAction):
    """Receive the gradient of this chunk's output from the next stage."""


@dataclass(frozen=True)
class Backward(MicroBatchAction):
    """Full backward of the chunk: input and weight gradients."""


@dataclass(frozen=True)
class BackwardInput(MicroBatchAction):
    """Input gradient only (the B pass of Qi et al., ICLR 2024)."""


@dataclass(frozen=True)
class BackwardWeight(MicroBatchAction):
    """Weight gradient only (the W pass of Qi et al., ICLR 2024)."""


@dataclass(frozen=True)
class SendGrad(MicroBatchAction):
    """Send the gradient of this chunk's input to the previous stage."""


@dataclass(frozen=True)
class ReduceTiedGrads(Action):
    """Sum gradients of modules tied across stages (once, at step end)."""


@dataclass(frozen=True)
class ReduceGrads(Action):
    """Data-parallel gradient reduction (once, after ReduceTiedGrads)."""


@dataclass(frozen=True)
class OptimizerStep(Action):
    """Optimizer step (once, the last action of a training step)."""


STEP_END = (ReduceTiedGrads(), ReduceGrads(), OptimizerStep())


def peer(action: MicroBatchAction, num_stages: int, stage_id: int,
         virtual_stages: int = 1) -> tuple[int, int]:
    """The (rank, chunk) a send or receive on rank ``stage_id`` talks to.

    Activations go to / come from the next / previous virtual stage, gradients
    the other way (mapping in [Note: the action contract]).

    Raises TypeError for an action that is no send or receive, and
    ValueError for one that has no neighbour (a receive of activations on the first stage, a
    send of activations on the last, and the like).
    """
    _check_grid(num_stages, stage_id, virtual_stages)
    if isinstance(action, (SendActivation, RecvGrad)):
        step = 1
    elif isinstance(action, (RecvActivation, SendGrad)):
        step = -1
    else:
        raise TypeError(f"peer() takes a Send*/Recv* action, got {action!r}")
    if not 0 <= action.chunk < virtual_stages:
        raise ValueError(f"{action!r}: chunk must be in 0..{virtual_stages - 1}")
    stage = action.chunk * num_stages + stage_id + step
    if not 0 <= stage < num_stages * virtual_stages:
        side = "last" if step == 1 else "first"
        raise ValueError(f"{action!r} on rank {stage_id} has no peer: its chunk is the {side} "
                         f"pipeline stage")
    return stage % num_stages, stage // num_stages


def build_schedule(name: str, num_stages: int, stage_id: int, num_micro_batches: int,
                   virtual_stages: int = 1) -> list[Action]:
    """The actions rank ``stage_id`` runs for one training step.

    - ``"1f1b"``: PipeDream-Flush (Narayanan et al., "Memory-Efficient
      Pipeline-Parallel DNN Training", ICML 2021), in DeepSpeed
      ``TrainSchedule``'s order: ``min(p - stage - 1, m)`` warm-up forwards,
      then one forward / one backward, then the cool-down backwards. At most
      ``min(p - stage, m)`` micro-batches hold activations on a stage.
    - ``"interleaved"``: interleaved 1F1B (Narayanan et al., SC21, section
      2.2), Megatron-LM's order. Needs ``virtual_stages >= 2``,
      ``num_stages >= 2`` and ``num_micro_batches % num_stages == 0``.
    - ``"zb-h1"``: ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
      ICLR 2024, section 2.1). The 1F1B order of forwards and B passes, with
      each backward split into ``BackwardInput`` (B) and ``BackwardWeight``
      (W); rank ``stage`` runs the W of micro-batch ``i`` right after the B of
      micro-batch ``i + stage`` (the rest after the last B), so the W passes
      fill the cool-down. Counting activations as held until W, every stage
      then holds up to ``min(p, m)`` micro-batches: the peak of 1F1B's first
      stage, which is the paper's memory bound (a W needs less than a full
      activation, and the first stage, holding the most, is unchanged).

    Args: ``num_stages`` p >= 1, ``stage_id`` in 0..p-1,
    ``num_micro_batches`` m >= 1, ``virtual_stages`` v (chunks per rank;
    1 except for "interleaved").

    Returns the list of actions (see [Note: the action contract]), ending
    with ReduceTiedGrads, ReduceGrads, OptimizerStep.

    Raises ValueError naming the valid choices for an unknown name or bad
    arguments.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    _check_grid(num_stages, stage_id, virtual_stages)
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    if name == "interleaved":
        order = _interleaved_order(num_stages, stage_id, num_micro_batches, virtual_stages)
    else:
        if virtual_stages != 1:
            raise ValueError(f"schedule {name!r} runs one chunk per rank (virtual_stages=1), got "
                             f"virtual_stages={virtual_stages}; use 'interleaved' for more")
        order = _one_f_one_b_order(num_stages, stage_id, num_micro_batches)
        if name == "zb-h1":
            order = _split_backwards(order, w_delay=stage_id)
    return _with_communication(order, num_stages, stage_id, virtual_stages) + list(STEP_END)


def inference_schedule(num_stages: int, stage_id: int, num_micro_batches: int) -> list[Action]:
    """The actions rank ``stage_id`` runs for ``eval_batch``: for each
    micro-batch in order, receive (or load), forward, send. No backward and
    no step-end actions; the last stage also loads labels for the loss.

    Raises ValueError for bad arguments.
    """
    _check_grid(num_stages, stage_id, 1)
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    order = [(Forward, mb, 0) for mb in range(num_micro_batches)]
    return _with_communication(order, num_stages, stage_id, 1)


def theoretical_bubble(name: str, num_stages: int, num_micro_batches: int, virtual_stages: int = 1,
                       forward_cost: float = 1.0, backward_input_cost: float = 1.0,
                       backward_weight_cost: float = 1.0) -> float:
    """The bubble fraction (idle time / step time on a rank) the papers give,
    with communication free. Costs are per chunk (F, B, W; a full backward
    is B + W).

    - ``"1f1b"``: (p-1)/(m+p-1), whatever the costs (Narayanan et al. 2021:
      bubble (p-1)(F+B+W) against m(F+B+W) of work).
    - ``"interleaved"``: (p-1)/(v*m+p-1) (SC21 section 2.2: the 1F1B bubble
      time divided by v, against v*m chunk passes of work).
    - ``"zb-h1"``: bubble time (p-1)(F+B-W) (Qi et al. 2024, section 2.1 and
      the table comparing the handcrafted schedules' bubble sizes; one third
      of 1F1B's (p-1)(F+B+W) when F = B = W), so the fraction is
      (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)). It holds for m >= p and
      W <= min(F, B) (the paper's setting, where W is not the longest pass;
      simulating ``build_schedule("zb-h1", ...)`` outside it gives more);
      other arguments raise ValueError.

    Raises ValueError for an unknown name or arguments build_schedule would
    refuse.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    _check_grid(num_stages, 0, virtual_stages)
    p, m, v = num_stages, num_micro_batches, virtual_stages
    if m < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {m}")
    if name == "1f1b":
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        _check_interleaved(p, m, v)
        return (p - 1) / (v * m + p - 1)
    if m < p:
        raise ValueError(f"the ZB-H1 bubble formula holds for num_micro_batches >= num_stages; "
                         f"got m={m} < p={p}")
    if backward_weight_cost > min(forward_cost, backward_input_cost):
        raise ValueError(f"the ZB-H1 bubble formula holds for backward_weight_cost <= min(forward_cost, "
                         f"backward_input_cost) (a W must fit the gap a B or F leaves); got "
                         f"F={forward_cost}, B={backward_input_cost}, W={backward_weight_cost}")
    bubble = (p - 1) * (forward_cost + backward_input_cost - backward_weight_cost)
    return bubble / (m * (forward_cost + backward_input_cost + backward_weight_cost) + bubble)


# A rank's compute order before communication is added: (kind, micro_batch, chunk)
# with kind one of Forward, Backward, BackwardInput, BackwardWeight.
_Order = list[tuple[type, int, int]]


def _check_grid(num_stages: int, stage_id: int, virtual_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"stage_id must be in 0..{num_stages - 1}, got {stage_id}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")


def _check_interleaved(p: int, m: int, v: int) -> None:
    if v < 2:
        raise ValueError(f"'interleaved' needs virtual_stages >= 2, got {v}; "
                         f"use '1f1b' for one chunk per rank")
    if p < 2:
        raise ValueError("'interleaved' needs num_stages >= 2 "
                         "(with one rank every chunk would send to itself)")
    if m % p:
        raise ValueError(f"'interleaved' needs num_micro_batches to be a multiple of num_stages; got "
                         f"m={m}, p={p} (try m={(m // p + 1) * p})")


def _one_f_one_b_order(p: int, stage: int, m: int) -> _Order:
    """PipeDream-Flush: warm-up forwards, 1F1B, cool-down backwards."""
    warmup = min(p - stage - 1, m)
    order = [(Forward, mb, 0) for mb in range(warmup)]
    for i in range(m - warmup):
        order += [(Forward, warmup + i, 0), (Backward, i, 0)]
    order += [(Backward, mb, 0) for mb in range(m - warmup, m)]
    return order


def _split_backwards(order: _Order, w_delay: int) -> _Order:
    """ZB-H1: each Backward becomes its B pass; the W of the k-th backward
    runs right after the B of the (k + w_delay)-th, the rest after the last."""
    out: _Order = []
    pending: list[tuple[type, int, int]] = []
    for kind, mb, chunk in order:
        if kind is not Backward:
            out.append((kind, mb, chunk))
            continue
        out.append((BackwardInput, mb, chunk))
        pending.append((BackwardWeight, mb, chunk))
        if len(pending) > w_delay:
            out.append(pending.pop(0))
    return out + pending


def _interleaved_order(p: int, rank: int, m: int, v: int) -> _Order:
    """Megatron-LM's interleaved 1F1B: chunks advance in groups of p
    micro-batches; forwards go chunk 0..v-1, backwards chunk v-1..0."""
    _check_interleaved(p, m, v)
    total = m * v

    def chunk_pass(k: int, backward: bool) -> tuple[int, int]:
        group, offset = divmod(k, p * v)
        chunk = (k // p) % v
        return group * p + offset % p, (v - 1 - chunk) if backward else chunk

    # Warm-up forwards: enough for chunk 0 of the first p micro-batches to reach
    # the last virtual stage and the first backward to come back.
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [(Forward, *chunk_pass(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [(Forward, *chunk_pass(warmup + k, False)), (Backward, *chunk_pass(k, True))]
    order += [(Backward, *chunk_pass(k, True)) for k in range(total - warmup, total)]
    return order


def _with_communication(order: _Order, p: int, rank: int, v: int) -> list[Action]:
    """Wrap each compute in its loads, receives and sends (rule 5 of the note)."""
    actions: list[Action] = []
    for kind, mb, chunk in order:
        first = rank == 0 and chunk == 0
        last = rank == p - 1 and chunk == v - 1
        if kind is Forward:
            if first or last:
                actions.append(LoadMicroBatch(mb, chunk))
            if not first:
                actions.append(RecvActivation(mb, chunk))
            actions.append(Forward(mb, chunk))
            if not last:
                actions.append(SendActivation(mb, chunk))
        elif kind is BackwardWeight:
            actions.append(BackwardWeight(mb, chunk))
        else:
            if not last:
                actions.append(RecvGrad(mb, chunk))
            actions.append(kind(mb, chunk))
            if not first:
                actions.append(SendGrad(mb, chunk))
    return actions

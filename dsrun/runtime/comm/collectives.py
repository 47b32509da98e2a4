"""The only calls into torch.distributed collectives in dsrun.

Every function takes its process group explicitly (None = the default
group), counts its traffic in `comms_logger`, and with `async_op=True`
returns a handle whose `wait()` blocks until the result is in place (the
torch.distributed Work object). Keeping them in one file makes the whole
communication pattern of the runtime reviewable in one place and lets the
comms logger see every byte.

[Note: choosing the transport]
Each tensor collective runs on one of two transports, recorded per call in
`comms_logger` ("shm" or "torch"; the bytes counted are the same):
- "shm": dsrun.ops.shm_comm, shared memory between the ranks of one node.
  On CPU it beats gloo's loopback TCP by 2-3x (bench/ops/bench_shm_comm.py)
  and its reduce-scatter/all-gather are cheaper than its all_reduce, as
  ZeRO's traffic model assumes.
- "torch": torch.distributed (gloo on CPU, nccl on GPU), for everything else.
The choice has two levels:
1. Per process group, once (cached): a gloo group of two or more ranks --
   the default (world) group or any subgroup (expert, expert-data, the
   data groups inside a pipeline, tensor groups ...) -- is served by shm
   when every rank of it is on this node (LOCAL_WORLD_SIZE == WORLD_SIZE,
   or the node map puts the group on one node), the native op loaded on
   every rank of it and DSRUN_SHM_COMM is not "0" there. Each served group
   has its own segment; `release(group)` (DeepSpeed's
   destroy_process_group calls it) or a new default group closes them.
2. Per call: the tensors must be contiguous CPU tensors and, for reductions,
   fp32/bf16/fp16 with SUM, MAX or MIN; else the call falls back to
   torch.distributed (same semantics, same errors). These properties are
   the same on every rank for one collective, so all ranks take the same
   transport.
The overlapped collectives (stage 0's gradient all-reduces, ZeRO's
reduce-scatters and all-gathers) on shm run on a communication thread
unless DSRUN_COMM_OVERLAP says otherwise ("sync": on the caller's thread;
"torch": gloo's async collectives); see [Note: overlap on a communication
thread].
On shm, all_reduce/reduce_scatter accumulate in fp32 in rank order and
round once, so every rank gets bit-identical results.

[Note: when the shm group is created]
Opening the segment is itself collective (two barriers over the world
group), so it must happen at a point every rank reaches in the same order.
We do it lazily, on the first tensor collective issued on the default group
(or the first `uses_shm` query for it): collectives are by definition issued
by every rank in the same order, so that is such a point, and jobs that
never communicate pay nothing. Before opening, the ranks agree by a one-
element all_reduce(MIN) that each can use shm (environment, native op), and
after opening that each succeeded; otherwise all stay on torch.distributed.
A rank that disagreed alone would otherwise wait in a barrier or a
collective the others never enter. A new default group (destroy and
re-init) gets a new choice. A subgroup is opened the same way, on its first
collective (or `uses_shm(group)`), with the agreement, the barriers and the
overlap mode's agreement over the subgroup's ranks only: its ranks issue its
collectives in the same order, so that point is again common to them, and
ranks outside it take no part. The first call on a group blocks until
every rank of it arrives, even with async_op=True (the agreement is
synchronous), as every later shm call does ([Note: shm is synchronous]).

[Note: shm is synchronous]
The shm collectives return when the result is in place; with async_op=True
the handle is already complete, and their time is counted as synchronous
seconds in the comms logger. The copies into and out of shared memory are
the work, done by the calling thread. The exceptions are the overlapped
collectives, below.

[Note: overlap on a communication thread]
`overlapped_all_reduce`, `overlapped_reduce_scatter` and
`overlapped_all_gather` are for a caller with compute to do until it waits:
stage 0 launches its gradient buckets from backward hooks, stages 1-3 their
gradient regions, stage 3 its unit gathers and prefetches, stages 1-2 the
gather of each run of buckets the optimizer has stepped. The last two take a
list of (output, input) pairs, one per bucket, run in order as one piece of
work with one handle. On a group that shm serves, DSRUN_COMM_OVERLAP picks
how they run:
- "thread" (the default): on this process's communication thread
  (comm_thread.py): one thread, one FIFO queue. ctypes releases the GIL for
  the native call and autograd releases it around every kernel, so
  backward goes on while the bucket is summed (and averaged) there. Every
  shm collective issued on the caller's thread first drains that queue
  (`_issue`), so shm collectives run in program order on every rank and
  the ShmGroup is never used by two threads at once. An error on the thread
  surfaces at the handle's `wait()`.
- "sync": on the caller's thread, finished when the call returns.
- "torch": gloo's async collectives, on gloo's own thread (2.5-3x shm's
  cost for all_reduce, more for gloo's reduce-scatter and all-gather).
The ranks agree on the mode when the shm group opens (one 2-element
all_reduce); if they differ, all use "sync" and a warning says so, because
"torch" on some ranks and shm on others would deadlock. Elsewhere (no
shm: GPU, groups across nodes) it is torch.distributed's async
collective whatever the mode.
Why "thread" is the default: with 2 ranks on 2 cores there is no idle core
to hide the copies in, so overlap cannot remove their CPU time (about 70 ms
per step for the 48M GPT's 192 MB of gradients, plus 10 ms to average);
what it can remove is waiting: a rank that reaches a bucket first goes on
with backward instead of waiting in the shm barrier for the slower one.
Measured on 2 cores shared with other jobs, 2 ranks x 1 thread, steps of
each mode alternated in one pair of processes with a no-sync floor step
(bench/step_time/gpt_step.py --paired; median of per-cycle ratios):
- 48M GPT, 7 runs of 10-30 cycles: thread ahead of sync in 4 (by 1-4% of
  the floor), level in 2, behind in 1 (by 0.8%). The last, with DDP in the
  same processes: thread 1.04x the floor and 0.95x DDP, sync 1.06x / 0.97x,
  torch 1.09x / 0.96x; CPU per step (both ranks) floor 5.08 s, thread
  5.16, sync 5.34, torch 5.40, DDP 5.53.
- 5.2M GPT, 6 runs of 20-60 cycles: in the 4 under heavy load thread
  1.05-1.07x the floor, sync 1.08-1.16x, torch 1.10-1.14x; in the 2 on a
  quieter machine thread and sync level (1.06-1.09x), torch 1.18x.
With more cores than ranks the thread also hides the copies themselves.
ZeRO stages 1-3 on the 48M GPT, each stage against itself in "sync" in the
same pair of processes (--paired ...,dsrun-N,dsrun-N:sync; 6 cycles under
a load of 23-36 on 2 cores): median per-cycle ratio to DDP thread/sync
1.06/1.14 (stage 1), 1.06/1.08 (stage 2), 1.15/1.25 (stage 3); CPU per step
(both ranks) 5.34/5.68, 5.57/5.42, 5.75/5.99 s (DDP 5.64, floor 5.01).
"""
from __future__ import annotations

import logging
import os
import weakref

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from dsrun.env import COMM_OVERLAP, SHM_COMM
from dsrun.ops import shm_comm
from dsrun.runtime.distributed import nodes
from dsrun.runtime.comm import comm_thread
from dsrun.runtime.comm.logger import comms_logger, timed
from dsrun.runtime.distributed.torch_collectives import all_gather_single, reduce_scatter_single
from dsrun.runtime.observability import heartbeat

log = logging.getLogger(__name__)

Handle = dist.Work

SHM = "shm"
TORCH = "torch"
_SHM_REDUCE_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}
OVERLAP_MODES = COMM_OVERLAP.choices  # sync, thread, torch; see [Note: overlap on a communication thread]


class CompletedWork(dist.Work):
    """Handle of a collective that finished before it returned (the shm path,
    see [Note: shm is synchronous]): `wait()` returns True at once."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _ThenWork(dist.Work):
    """An async handle plus what to do when it completes: the first `wait()`
    (on the waiting thread) counts the seconds it blocked as `op`'s wait time
    in the comms logger (when `op` is given), then runs `then`, then records
    the collective numbered `beat_seq` as finished in the heartbeat (see
    [Note: heartbeats] in dsrun/runtime/observability/heartbeat.py)."""

    def __init__(self, work: dist.Work, then=None, op: str | None = None, beat_seq: int = 0) -> None:
        super().__init__()
        self._work, self._then, self._op, self._done, self._beat_seq = work, then, op, False, beat_seq

    def wait(self, timeout=None) -> bool:
        if not self._done:
            with timed() as t:
                self._work.wait()
            if self._op is not None:
                comms_logger.record_wait(self._op, t.seconds)
            if self._then is not None:
                self._then()
            self._done = True
            heartbeat.collective_finished(self._beat_seq)
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done


class _Choice:
    """The transport chosen for one process group: its ShmGroup (None: torch.distributed)
    and how its overlapped collectives run (agreed by its ranks)."""

    __slots__ = ("shm", "overlap")

    def __init__(self, shm: shm_comm.ShmGroup | None, overlap: str) -> None:
        self.shm, self.overlap = shm, overlap


class _WorldShm:
    """The transport choices made for the current default group and its
    subgroups (see [Note: when the shm group is created])."""

    # The default group the choices were made for, weakly: holding a
    # destroyed group alive until exit would tear gloo down at interpreter
    # shutdown. Subgroups are keys of a weak dictionary for the same reason.
    pg: weakref.ref | None = None
    group: shm_comm.ShmGroup | None = None
    overlap: str = "sync"  # what overlapped_all_reduce does on the world group (agreed by all ranks)
    subgroups: "weakref.WeakKeyDictionary[ProcessGroup, _Choice]" = weakref.WeakKeyDictionary()


def _shm_enabled_by_env() -> bool:
    return SHM_COMM.read()


def overlap_mode() -> str:
    """How `overlapped_all_reduce` runs on a shm-served group: DSRUN_COMM_OVERLAP
    (see [Note: overlap on a communication thread])."""
    return COMM_OVERLAP.read()


def _all_ranks_agree(ok: bool, group: ProcessGroup | None = None) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=ReduceOp.MIN, group=group)  # set-up traffic, not counted
    return bool(flag.item())


def _agreed_overlap_mode(group: ProcessGroup | None = None) -> str:
    """The DSRUN_COMM_OVERLAP of every rank of `group`, or "sync" (with a
    warning) where they differ: "torch" on some ranks and shm on others would
    deadlock."""
    index = OVERLAP_MODES.index(overlap_mode())
    extremes = torch.tensor([index, -index], dtype=torch.int32)
    dist.all_reduce(extremes, op=ReduceOp.MIN, group=group)  # set-up traffic, not counted
    low, high = int(extremes[0]), -int(extremes[1])
    if low != high:
        log.warning("dsrun.comm: DSRUN_COMM_OVERLAP differs between ranks (%s ... %s); using sync",
                    OVERLAP_MODES[low], OVERLAP_MODES[high])
        return "sync"
    return OVERLAP_MODES[low]


def _on_this_node(group: ProcessGroup | None) -> bool:
    """True when every rank of `group` runs on this node: the whole job does
    (LOCAL_WORLD_SIZE == WORLD_SIZE), or the node map puts the group's ranks
    on one node."""
    env = os.environ
    if (env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE") == str(dist.get_world_size())
            and env.get("RANK") == str(dist.get_rank())):
        return True
    node_map = nodes.current()
    return (group is not None and node_map is not None
            and node_map.within_one_node(dist.get_process_group_ranks(group)))


def _open_shm(group: ProcessGroup | None) -> shm_comm.ShmGroup | None:
    """The ShmGroup over `group` (None: the default group), or None;
    collective over the group's ranks. Every rank of the group agrees that it
    can use shm before the segment is opened, and that it opened it after;
    otherwise all keep torch.distributed."""
    size = dist.get_world_size(group)
    if size == 1 or dist.get_backend(group) != "gloo":
        return None  # the same answer on every rank: no agreement needed
    able = _shm_enabled_by_env() and shm_comm.available() and _on_this_node(group)
    if not _all_ranks_agree(able, group):
        return None
    shm, error = None, None
    try:
        # The world keeps its segment name; a subgroup's is named after
        # torch's group name, which its ranks share and which differs between
        # groups of other ranks (groups of the same ranks open one after the
        # other, each name removed once mapped: [Note: shm crash safety]).
        tag = "world" if group is None else f"pg{group.group_name}"
        shm = shm_comm.ShmGroup(shm_comm.segment_name(shm_comm.job_name(), tag), dist.get_rank(group), size,
                                barrier=lambda: dist.barrier(group=group))
    except shm_comm.ShmCollectiveError as e:
        error = e
    if not _all_ranks_agree(shm is not None, group):
        if shm is not None:
            shm.close()
        log.warning("dsrun.comm: shared-memory collectives unavailable on some rank (%s); "
                    "using torch.distributed", error or "another rank failed")
        return None
    return shm


def _forget_all() -> None:
    """Close every ShmGroup of the old default group (after the
    communication thread has run what is queued on them)."""
    comm_thread.shutdown()  # runs what is queued on the old groups, forgets its errors
    for choice in list(_WorldShm.subgroups.values()):
        if choice.shm is not None:
            choice.shm.close()
    _WorldShm.subgroups.clear()
    if _WorldShm.group is not None:
        _WorldShm.group.close()
        _WorldShm.group = None
    _WorldShm.pg = None


def _choice(group: ProcessGroup | None) -> _Choice | None:
    """The transport of `group`: None when torch.distributed serves it (not
    initialised, or no shm), else its ShmGroup and overlap mode. Collective
    over the group's ranks on the first call for a group."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _WorldShm.pg is None or _WorldShm.pg() is not world:
        _forget_all()
        _WorldShm.group = _open_shm(None)
        _WorldShm.overlap = _agreed_overlap_mode() if _WorldShm.group is not None else "sync"
        _WorldShm.pg = weakref.ref(world)
    if group is None or group is world:
        return _Choice(_WorldShm.group, _WorldShm.overlap) if _WorldShm.group is not None else None
    choice = _WorldShm.subgroups.get(group)
    if choice is None:
        if dist.get_rank(group) < 0:
            return None  # not a member: torch.distributed raises its own error
        shm = _open_shm(group)
        choice = _Choice(shm, _agreed_overlap_mode(group) if shm is not None else "sync")
        _WorldShm.subgroups[group] = choice
    return choice if choice.shm is not None else None


def _world_shm(group: ProcessGroup | None) -> shm_comm.ShmGroup | None:
    """The ShmGroup serving `group` (the default group or a subgroup), or
    None when torch.distributed serves it. Collective on the first call."""
    choice = _choice(group)
    return None if choice is None else choice.shm


def release(group: ProcessGroup | None = None) -> None:
    """Close the shared-memory segment serving `group` (None: the default
    group and every subgroup), before the group is destroyed; what the
    communication thread has queued runs first. Not collective."""
    if group is None or group is dist.group.WORLD:
        _forget_all()
        return
    choice = _WorldShm.subgroups.pop(group, None)
    if choice is not None and choice.shm is not None:
        comm_thread.drain()
        choice.shm.close()


def uses_shm(group: ProcessGroup | None = None) -> bool:
    """True when contiguous CPU tensors of supported dtypes in `group` (None:
    the default group) go over shared memory (see [Note: choosing the
    transport]). Every rank of the group must call it at the same point the
    first time (it may open the group's shm segment)."""
    return _world_shm(group) is not None


def _served(group: ProcessGroup | None, *tensors: torch.Tensor,
            reduce_op: ReduceOp | None = None) -> shm_comm.ShmGroup | None:
    """The ShmGroup to run this call on, or None for torch.distributed."""
    shm = _world_shm(group)
    if shm is None or (reduce_op is not None and reduce_op not in _SHM_REDUCE_OPS):
        return None
    return shm if shm_comm.supports(*tensors, reduce=reduce_op is not None) else None


def _issue(name: str, counted: torch.Tensor, group: ProcessGroup | None, async_op: bool,
           served, on_shm, on_torch) -> Handle | None:
    """Run one collective: `served()` (None: torch.distributed only) picks the
    ShmGroup or None, then `on_shm(shm)` or `on_torch()` runs it. The
    heartbeat records it as entered before `served()` (which may itself
    communicate, see [Note: when the shm group is created]) and as finished
    when it returns, or at its handle's `wait()` when async."""
    world = get_world_size(group)
    beat_seq = heartbeat.collective_entered(name, world, counted.numel() * counted.element_size())
    shm = served() if served is not None else None
    with timed() as t:
        if shm is not None:
            comm_thread.drain()  # see [Note: overlap on a communication thread]
            on_shm(shm)
            handle = CompletedWork() if async_op else None
        else:
            handle = on_torch()
    synchronous = shm is not None or not async_op
    if synchronous:
        heartbeat.collective_finished(beat_seq)
    else:
        handle = _ThenWork(handle, op=name, beat_seq=beat_seq)
    comms_logger.record(name, counted, t.seconds if synchronous else 0.0,
                        transport=SHM if shm is not None else TORCH, group_size=world,
                        inter_node=nodes.spans_nodes(group))
    return handle


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
               group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Reduce `tensor` (any shape/dtype) in place across the ranks of `group`.

    gloo has no ReduceOp.AVG: average by SUM then dividing by the world size.
    On shm (see [Note: choosing the transport]) 16-bit tensors are summed in
    fp32 and rounded once.
    """
    return _issue("all_reduce", tensor, group, async_op, lambda: _served(group, tensor, reduce_op=op),
                  lambda shm: shm.all_reduce(tensor, _SHM_REDUCE_OPS[op]),
                  lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def _overlapped(name: str, counted: list[torch.Tensor], group: ProcessGroup | None, shm,
                on_shm, on_torch, finish) -> Handle:
    """Run the collectives `on_shm(shm)` (one call doing them all, in order)
    or `on_torch()` (issuing them async, returning their Works) the way
    DSRUN_COMM_OVERLAP says (see [Note: overlap on a communication thread]),
    counting each tensor of `counted` as one `name` call; `finish()` runs
    before the returned handle's `wait()` returns."""
    world, inter_node = get_world_size(group), nodes.spans_nodes(group)
    beat_seq = heartbeat.collective_entered(name, world, sum(t.numel() * t.element_size() for t in counted))
    mode = _choice(group).overlap if shm is not None else TORCH
    if mode == "sync":
        with timed() as t:
            comm_thread.drain()
            on_shm(shm)
            finish()
        heartbeat.collective_finished(beat_seq)
        for i, tensor in enumerate(counted):
            comms_logger.record(name, tensor, t.seconds if i == 0 else 0.0, transport=SHM, group_size=world,
                                inter_node=inter_node)
        return CompletedWork()
    for tensor in counted:
        comms_logger.record(name, tensor, 0.0, transport=TORCH if mode == TORCH else SHM, group_size=world,
                            inter_node=inter_node)
    if mode == TORCH:
        works = on_torch()
        return _ThenWork(_AllWork(works), finish, name, beat_seq)

    def run_and_finish() -> None:
        on_shm(shm)
        finish()
    return _ThenWork(comm_thread.get().submit(name, run_and_finish), op=name, beat_seq=beat_seq)


class _AllWork(dist.Work):
    """Several async Works as one: `wait()` waits for each, in order."""

    def __init__(self, works: list) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait()
        return True


def overlapped_all_reduce(tensor: torch.Tensor, group: ProcessGroup | None = None,
                          average: bool = False) -> Handle:
    """Sum `tensor` in place across `group` while the caller keeps computing
    (stage 0's gradient buckets during backward); with `average`, divide
    the sum by the group's size before `wait()` returns.

    Where the group is served by shm, DSRUN_COMM_OVERLAP (agreed by every
    rank) picks how it runs: see [Note: overlap on a communication thread].
    Elsewhere it is the torch.distributed async all_reduce. Returns the
    handle to wait on; the tensor must not be touched before `wait()`
    returns.
    """
    world = get_world_size(group)
    finish = (lambda: tensor.div_(world)) if average and world > 1 else (lambda: None)
    return _overlapped("all_reduce", [tensor], group, _served(group, tensor, reduce_op=ReduceOp.SUM),
                       lambda shm: shm.all_reduce(tensor, "sum"),
                       lambda: [dist.all_reduce(tensor, group=group, async_op=True)], finish)


def overlapped_reduce_scatter(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                              group: ProcessGroup | None = None) -> Handle:
    """`reduce_scatter_tensor(output, input)` (SUM) for each (output [n],
    input [world*n]) pair, in order, while the caller keeps computing
    (ZeRO's gradient regions during backward): one handle for all, run as
    `overlapped_all_reduce` runs (DSRUN_COMM_OVERLAP, [Note: overlap on a
    communication thread]). An output may alias its rank's slice of the
    input. Nothing in `pairs` may be touched before `wait()` returns."""
    shm = _world_shm(group)
    if shm is not None and not all(shm_comm.supports(o, i, reduce=True) for o, i in pairs):
        shm = None

    def on_shm(g: shm_comm.ShmGroup) -> None:
        for o, i in pairs:
            g.reduce_scatter(o, i, "sum")
    return _overlapped("reduce_scatter_tensor", [i for _, i in pairs], group, shm, on_shm,
                       lambda: [reduce_scatter_single(o, i, group=group, async_op=True) for o, i in pairs],
                       lambda: None)


def overlapped_all_gather(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                          group: ProcessGroup | None = None) -> Handle:
    """`all_gather_into_tensor(output, input)` for each (output [world*n],
    input [n]) pair, in order, while the caller keeps computing (stage 3's
    unit gathers and prefetches, stages 1-2's updated parameters): one
    handle for all, run as `overlapped_all_reduce` runs. An input may be
    its rank's slice of the output. Nothing in `pairs` may be touched
    before `wait()` returns."""
    shm = _world_shm(group)
    if shm is not None and not all(shm_comm.supports(o, i, reduce=False) for o, i in pairs):
        shm = None

    def on_shm(g: shm_comm.ShmGroup) -> None:
        for o, i in pairs:
            g.all_gather(o, i)
    return _overlapped("all_gather_into_tensor", [o for o, _ in pairs], group, shm, on_shm,
                       lambda: [all_gather_single(o, i, group=group, async_op=True) for o, i in pairs],
                       lambda: None)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
              async_op: bool = False) -> Handle | None:
    """Overwrite `tensor` on every rank with global rank `src`'s copy."""
    return _issue("broadcast", tensor, group, async_op, lambda: _served(group, tensor),
                  lambda shm: shm.broadcast(tensor, src if group is None else dist.get_group_rank(group, src)),
                  lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor,
                           group: ProcessGroup | None = None,
                           async_op: bool = False) -> Handle | None:
    """Concatenate every rank's `input` (shape [n]) into `output` (shape [world*n]), rank order."""
    return _issue("all_gather_into_tensor", output, group, async_op, lambda: _served(group, output, input),
                  lambda shm: shm.all_gather(output, input),
                  lambda: all_gather_single(output, input, group=group, async_op=async_op))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor,
                          op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                          async_op: bool = False) -> Handle | None:
    """Reduce `input` (shape [world*n]) across ranks; rank r keeps slice r in `output` ([n])."""
    return _issue("reduce_scatter_tensor", input, group, async_op,
                  lambda: _served(group, output, input, reduce_op=op),
                  lambda shm: shm.reduce_scatter(output, input, _SHM_REDUCE_OPS[op]),
                  lambda: reduce_scatter_single(output, input, op=op, group=group, async_op=async_op))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Handle | None:
    """Personalised exchange: `input` (shape [world*n], any dtype) is cut into
    world equal blocks; block j goes to rank j, and `output` ([world*n]) holds
    block `rank` of every rank, in rank order. On a group shm serves (see
    [Note: choosing the transport]) it runs there, synchronously; `output`
    must then not overlap `input`."""
    return _issue("all_to_all_single", input, group, async_op, lambda: _served(group, output, input),
                  lambda shm: shm.all_to_all(output, input),
                  lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op))


def all_gather_object(obj: object, group: ProcessGroup | None = None) -> list[object]:
    """Every rank's picklable `obj`, in rank order (small control data only: it pickles)."""
    out: list[object] = [None] * dist.get_world_size(group)
    beat_seq = heartbeat.collective_entered("all_gather_object", len(out), 0)
    dist.all_gather_object(out, obj, group=group)
    heartbeat.collective_finished(beat_seq)
    comms_logger.record("all_gather_object", torch.empty(0))
    return out


def barrier(group: ProcessGroup | None = None) -> None:
    """Block until every rank of `group` reaches this call."""
    beat_seq = heartbeat.collective_entered("barrier", get_world_size(group), 0)
    dist.barrier(group=group)
    heartbeat.collective_finished(beat_seq)
    comms_logger.record("barrier", torch.empty(0))


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in `group` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """LOCAL_RANK from the rank environment (0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_initialized()

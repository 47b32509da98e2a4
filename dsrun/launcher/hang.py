"""Hung-rank detection, the agent's side: heartbeat files, the stall rule, stack dumps, the hang report.

[Note: hung ranks]
With `dsrun --hang_timeout T` (default 600 s; 0 turns it off) each agent
makes a private directory with one heartbeat file per rank and names it to
the rank as DSRUN_HEARTBEAT_FILE; the rank beats into it from its training
progress (see [Note: heartbeats] in dsrun/runtime/observability/
heartbeat.py). Every `period` seconds (T/10, at most 1 s) the agent reads
each running rank's beat count. The rule:

- a rank is *hung* when its count is above 0 and has not changed for T
  seconds of the agent's clock; it is detected within T + 2 periods of its
  last beat;
- a rank whose count is still 0 is never hung: it has not begun to beat
  (start-up, however long, or a script that does not use dsrun's
  collectives or engine);
- a rank that marked itself exiting (atexit) is no longer watched;
- a rank inside `deepspeed.initialize` (header flag "setting up") is not
  watched, and its timeout starts afresh when initialize returns.

When ranks are hung the agent asks every running rank of its node that
registered a stack dump handler for its stacks (`DUMP_SIGNAL`, sent to
that pid only, never to a rank that did not register: the signal would
kill it), waits up to `_DUMP_WAIT_S` for them, and writes one `HangReport`
line on its stderr: every rank's beat count, step, time since its last
beat, last collective (op, group size, bytes, when entered, whether
finished) and stacks. Then it reports each hung rank as an ordinary rank
failure with reason "hung" and exit status `HANG_EXIT_CODE` (124, as
timeout(1)), longest silent first, and stops the job as for any rank
failure (so `--max_restarts` restarts it). Across nodes each agent watches
its own ranks; the head, on a "hung" failure, asks the other agents for
their reports too (a "dump" control line) before stopping them, so the
summary holds the stacks of every rank of the job.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dsrun.env import HEARTBEAT_FILE
from dsrun.launcher.job import NodeJob
from dsrun.launcher.records import LineRecord, parse_record
from dsrun.runtime.observability.heartbeat import (DUMP_SIGNAL, HeartbeatState, create_heartbeat_file,
                                                   read_heartbeat, stacks_path)

HANG_REASON = "hung"
# Exit status of a rank reported hung: timeout(1)'s.
HANG_EXIT_CODE = 124
HANG_PREFIX = "@@dsrun-hang@@ "
# Longest wait for the ranks' stack dumps, seconds; a dump is complete once its file stops growing for _SETTLE_S.
_DUMP_WAIT_S = 3.0
_SETTLE_S = 0.1
# Most time between two readings of the heartbeat files, seconds.
_MAX_PERIOD_S = 1.0


@dataclass(kw_only=True)
class CollectiveCall:
    """The last collective a rank entered (see heartbeat.CollectiveState).

    Attributes:
        seq: how many collectives the rank had entered, this one included.
        op, group_size: the collective and the size of its group.
        bytes: message bytes, as dsrun's comms logger counts them.
        entered: wall time (time.time()) the rank entered it.
        finished: wall time it returned; None: the rank is still inside.
    """

    seq: int
    op: str
    group_size: int
    bytes: int
    entered: float
    finished: float | None


@dataclass(kw_only=True)
class RankSnapshot:
    """One rank's state when a hang was reported.

    Attributes:
        rank: global rank.
        pid: the rank's process id; None if it is not running.
        beats: heartbeats so far; 0: the rank had not begun to beat.
        step: last engine step it reached, None if none.
        silent_s: seconds since its last beat (agent's clock); None before the first.
        collective: the last collective it entered, None if none.
        stacks: every Python thread's stack (faulthandler); None if it gave none.
    """

    rank: int
    pid: int | None
    beats: int
    step: int | None
    silent_s: float | None
    collective: CollectiveCall | None
    stacks: str | None

    def __post_init__(self) -> None:
        if isinstance(self.collective, dict):  # read back from JSON (HangReport.from_line)
            self.collective = parse_record(CollectiveCall, self.collective)


@dataclass(kw_only=True)
class HangReport(LineRecord):
    """What an agent saw when a hang was reported: every running rank of its node.

    Attributes:
        host, node_rank: the node.
        timeout: the job's --hang_timeout, seconds.
        time: wall time of the report.
        hung: ranks of this node found hung (empty when the head asked for the report).
        ranks: a snapshot of every rank of the node.
    """

    host: str
    node_rank: int
    timeout: float
    time: float
    hung: list[int]
    ranks: list[RankSnapshot]

    LINE_PREFIX = HANG_PREFIX

    def __post_init__(self) -> None:
        self.ranks = [parse_record(RankSnapshot, r) if isinstance(r, dict) else r for r in self.ranks]


def likely_causes(snapshots: list[RankSnapshot]) -> list[int]:
    """Ranks that probably hold the others up, among those that began to beat.

    Ranks outside any collective while others wait inside one; else (every
    rank inside one, or none: NCCL's collectives return once enqueued and
    the wait is at the next synchronisation) the ranks that entered fewer
    collectives than the others. Empty when nothing stands out.
    """
    started = [s for s in snapshots if s.beats > 0]
    inside = [s for s in started if s.collective is not None and s.collective.finished is None]
    outside = [s.rank for s in started if s not in inside]
    if inside and outside:
        return outside
    seqs = {s.rank: s.collective.seq if s.collective is not None else 0 for s in started}
    most = max(seqs.values(), default=0)
    return [rank for rank, seq in seqs.items() if seq < most]


class HangWatch:
    """The heartbeat files of one node's ranks and the stall rule of [Note: hung ranks].

    Use `create(job)`; `close()` removes the directory.
    """

    def __init__(self, directory: Path, ranks: list[int], timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"a hang timeout must be > 0 seconds, got {timeout}")
        self.directory = directory
        self.timeout = timeout
        self.period = min(_MAX_PERIOD_S, timeout / 10)
        self._ranks = list(ranks)
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat count, monotonic time it was first seen)
        self._next_read = 0.0
        for rank in self._ranks:
            create_heartbeat_file(self.path(rank))

    @classmethod
    def create(cls, job: NodeJob) -> "HangWatch | None":
        """A watch over `job`'s ranks in a new private directory, or None when job.hang_timeout is 0.

        Raises OSError when the directory or files cannot be made.
        """
        if job.hang_timeout == 0:
            return None
        directory = Path(tempfile.mkdtemp(prefix=f"{job.job_id}-node{job.node_rank}-heartbeat-"))
        try:
            return cls(directory, job.ranks, job.hang_timeout)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def path(self, rank: int) -> Path:
        """The heartbeat file of global rank `rank`."""
        return self.directory / f"rank_{rank}"

    def rank_env(self, rank: int) -> dict[str, str]:
        """The variable naming `rank`'s heartbeat file to it."""
        return {HEARTBEAT_FILE.name: str(self.path(rank))}

    def _read(self, rank: int) -> HeartbeatState | None:
        try:
            return read_heartbeat(self.path(rank))
        except (OSError, ValueError):
            return None  # removed or overwritten by the rank itself: it cannot be watched

    def stalled(self, running: Iterable[int], now: float | None = None) -> list[int]:
        """The ranks among `running` that are hung (see [Note: hung ranks]), longest silent first.

        Reads the files at most once per `period`; between readings returns [].
        `now` is time.monotonic() (a parameter for tests).
        """
        now = time.monotonic() if now is None else now
        if now < self._next_read:
            return []
        self._next_read = now + self.period
        silent = []
        for rank in running:
            state = self._read(rank)
            if state is not None and state.exiting:
                continue
            beats = state.beats if state is not None else 0
            seen = self._seen.get(rank)
            if state is not None and state.setting_up:  # inside initialize: the timeout starts after it
                self._seen[rank] = (beats, now)
                continue
            if seen is None or seen[0] != beats:
                self._seen[rank] = (beats, now)
            elif beats > 0 and now - seen[1] >= self.timeout:
                silent.append((seen[1], rank))
        return [rank for _, rank in sorted(silent)]

    def snapshot(self, pids: dict[int, int], now: float | None = None) -> list[RankSnapshot]:
        """Every rank in `pids` (rank -> pid of its process, the leader of its group): its state and stacks.

        Signals each rank that registered its dump handler (its pid in the
        header, in the rank's process group) and waits up to _DUMP_WAIT_S for
        the dumps.
        """
        states = {rank: self._read(rank) for rank in pids}
        asked = []
        for rank, leader in pids.items():
            state = states[rank]
            if state is not None and state.pid and _in_group(state.pid, leader):
                try:
                    os.kill(state.pid, DUMP_SIGNAL)
                    asked.append(rank)
                except OSError:
                    continue
        stacks = self._collect_stacks(asked)
        now = time.monotonic() if now is None else now
        snapshots = []
        for rank, leader in pids.items():
            state, seen = states[rank], self._seen.get(rank)
            beats = state.beats if state is not None else 0
            silent = now - seen[1] if beats > 0 and seen is not None and seen[0] == beats else None
            call = state.collective if state is not None else None
            snapshots.append(RankSnapshot(
                rank=rank, pid=leader, beats=beats, step=state.step if state is not None else None,
                silent_s=silent if silent is not None else _wall_silence(state),
                collective=CollectiveCall(seq=call.seq, op=call.op, group_size=call.group_size, bytes=call.nbytes,
                                          entered=call.entered, finished=call.finished) if call else None,
                stacks=stacks.get(rank)))
        return snapshots

    def _collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """The dumps of `ranks`, each read once its file stopped growing (or at the deadline); files emptied."""
        files = {rank: stacks_path(self.path(rank)) for rank in ranks}
        sizes: dict[int, tuple[int, float]] = {}
        deadline = time.monotonic() + _DUMP_WAIT_S
        pending = set(ranks)
        while pending and time.monotonic() < deadline:
            for rank in list(pending):
                size = _size(files[rank])
                last = sizes.get(rank)
                if last is None or last[0] != size:
                    sizes[rank] = (size, time.monotonic())
                elif size > 0 and time.monotonic() - last[1] >= _SETTLE_S:
                    pending.discard(rank)
            time.sleep(0.01)
        out = {}
        for rank, path in files.items():
            try:
                text = path.read_text(errors="replace")
                path.write_bytes(b"")  # the rank appends (O_APPEND): the next dump starts the file again
            except OSError:
                continue
            if text.strip():
                out[rank] = text.rstrip("\n")
        return out

    def close(self) -> None:
        """Remove the directory and its files."""
        shutil.rmtree(self.directory, ignore_errors=True)


def _wall_silence(state: HeartbeatState | None) -> float | None:
    """Seconds since the last beat by the wall clock, for a rank the agent had not read since it last beat."""
    if state is None or state.beats == 0:
        return None
    return max(0.0, time.time() - state.last_beat)


def _in_group(pid: int, pgid: int) -> bool:
    """Whether process `pid` is in process group `pgid` (so it is the rank or one of its own processes)."""
    try:
        return os.getpgid(pid) == pgid
    except OSError:
        return False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

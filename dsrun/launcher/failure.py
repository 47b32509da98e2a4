"""Failure records: what an agent tells the head about a rank that died.

An agent writes each record as one line on its stderr, prefixed with
`FAILURE_PREFIX`, so the record travels over whatever carries the agent's
output (a local pipe, an SSH channel, srun) without a second channel. The
head strips these lines from the output it shows and prints the summary.
"""
from __future__ import annotations

import collections
import signal

from dataclasses import dataclass, field

from dsrun.launcher.records import LineRecord

FAILURE_PREFIX = "@@dsrun-failure@@ "

# Enough for the last frames of a typical traceback plus a few lines of context.
TAIL_LINES = 40
# A traceback block longer than this keeps its first and last halves.
TRACEBACK_MAX_LINES = 400

_TRACEBACK_START = "Traceback (most recent call last):"
# Lines Python prints between the tracebacks of chained exceptions.
_CHAIN_LINES = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


@dataclass(kw_only=True)
class RankFailure(LineRecord):
    """One rank that exited non-zero on its own (not because dsrun stopped it), or that its agent found hung.

    Attributes:
        host: node name the rank ran on.
        node_rank, local_rank: the node's index and the rank's index on it.
        rank: global rank.
        pid: process id on its node; None if it never started.
        exit_code: shell-style status: the exit code, or 128+signum for a signal.
        signal: signal name (e.g. 'SIGKILL') if a signal ended the rank.
        stderr_tail: last `TAIL_LINES` lines of the rank's stderr.
        traceback: last Python traceback the rank printed, whole, if any.
        time: wall-clock time (time.time(), seconds) the agent saw the exit; orders failures.
        reason: why the agent failed a rank that had not exited: "hung" (no
            heartbeat within --hang_timeout, see launcher/hang.py); None for
            a rank that exited non-zero.
    """

    host: str
    node_rank: int
    rank: int
    local_rank: int
    pid: int | None
    exit_code: int
    signal: str | None = None
    stderr_tail: list[str] = field(default_factory=list)
    traceback: str | None = None
    time: float
    reason: str | None = None

    LINE_PREFIX = FAILURE_PREFIX


# What a rank prints when it lost a peer (gloo's TCP pair, torch's store,
# dsrun's shared-memory collectives and channels, csrc/shm_comm/): a
# consequence of another rank's failure, not a cause.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", ") exited while rank ")


def lost_a_peer(stderr_lines: list[str]) -> bool:
    """Whether a failed rank's stderr says it lost a peer's connection (so
    its failure followed another rank's)."""
    return any(marker in line for line in stderr_lines for marker in _PEER_LOST)


def by_root_cause(failures: list[RankFailure]) -> list[RankFailure]:
    """`failures` with the likely root cause first: see [Note: root cause order].

    [Note: root cause order]
    When one rank dies, its peers fail too, and which exit a launcher sees
    first is a matter of scheduling: on a loaded machine a peer's "rank 1
    (pid N) exited while rank 2 waited" can reach the agent, or travel from
    another node to the head, before the dead rank's own exit. So failures
    are ordered by what they say, and only then by when they were seen:
    first a rank that a signal ended (SIGKILL from the OOM killer, SIGSEGV)
    or that its agent found hung, then a rank that failed on its own (a
    Python exception, an exit code), last a rank whose stderr says it lost a
    peer (`lost_a_peer`), which follows some other rank's failure by
    definition. A signal death whose stderr says it lost a peer (gloo aborts
    with SIGABRT when its connection is reset) is a consequence too. Within
    a class the earliest record comes first. The same order gives the agent's
    exit status, the head's restart line and the summary's "root cause".
    """
    def key(failure: RankFailure) -> tuple[int, float]:
        if lost_a_peer(failure.stderr_tail):
            return 2, failure.time
        return (0 if failure.signal is not None or failure.reason is not None else 1), failure.time

    return sorted(failures, key=key)


def exit_status(returncode: int) -> int:
    """Shell-style exit status of a Popen returncode: a signal N (returncode -N) becomes 128+N.

    This keeps a rank killed by a signal from ever reading as success.
    """
    return 128 - returncode if returncode < 0 else returncode


def signal_name(returncode: int) -> str | None:
    """Name of the signal that ended a process (Popen returncode -N), else None."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


class StderrTail:
    """Keeps the end of a rank's stderr, and its last Python traceback whole.

    A fixed tail of `TAIL_LINES` lines can cut a deep traceback, so lines from
    a "Traceback (most recent call last):" header on are kept separately,
    including chained exceptions, up to `TRACEBACK_MAX_LINES`. The header may
    follow a prefix (torch writes `[rank1]: ` before every line of a rank's
    output under some settings; so do loggers and `ts`): whatever precedes
    it on its line is taken as the prefix of the whole block. Lines are str
    without their newline. Not thread-safe: feed it from one thread.
    """

    def __init__(self) -> None:
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._block: list[str] | None = None
        self._block_dropped = 0

    def add(self, line: str) -> None:
        """Record one line of stderr (without the newline)."""
        head, found, rest = line.rstrip().rpartition(_TRACEBACK_START)
        if found and not rest:
            prefix = head.strip()
            texts = (ln.strip().removeprefix(prefix).strip() for ln in reversed(self._tail))
            previous = next((text for text in texts if text), "")
            if self._block is None or previous not in _CHAIN_LINES:
                self._block, self._block_dropped = [], 0
        self._tail.append(line)
        if self._block is not None:
            if len(self._block) < TRACEBACK_MAX_LINES:
                self._block.append(line)
            else:
                # Keep the head (where the chain started) and the tail (the
                # final exception) of a runaway block; drop from the middle.
                del self._block[TRACEBACK_MAX_LINES // 2]
                self._block.append(line)
                self._block_dropped += 1

    def lines(self) -> list[str]:
        """The last `TAIL_LINES` lines."""
        return list(self._tail)

    def traceback(self) -> str | None:
        """The last traceback block (and what followed it), or None if no traceback was seen."""
        if self._block is None:
            return None
        block = list(self._block)
        if self._block_dropped:
            block.insert(TRACEBACK_MAX_LINES // 2, f"... ({self._block_dropped} lines omitted) ...")
        return "\n".join(block)


@dataclass(kw_only=True)
class AgentFailure:
    """A node whose agent exited non-zero without reporting a rank failure.

    This is what the head sees when an agent could not start (bad job, no
    Python on the node), crashed, or lost its connection.

    Attributes:
        host, node_rank: the node.
        exit_code: shell-style exit status of the agent (or of its transport, e.g. ssh).
        output_tail: last lines the agent wrote on stderr.
    """

    host: str
    node_rank: int
    exit_code: int
    output_tail: list[str] = field(default_factory=list)

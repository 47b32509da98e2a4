"""The per-node agent: starts one node's ranks, streams their output, tears down on failure.

Run as ``python -m dsrun.launcher.agent``. It reads a `NodeJob` as one JSON
line on stdin, then keeps reading stdin for control lines from the head
(see `control_line`). Its exit status is the root-cause rank's (128+N for a
signal N; 124 for a rank found hung, see [Note: hung ranks] in hang.py),
128+N when stopped by signal N, 129 when stdin reached EOF (the head or the
SSH channel went away), 0 only if every rank exited 0.

[Note: agent process tree]
Each rank is the leader of its own session (start_new_session), so a
terminal's Ctrl-C reaches only the head, which decides what to forward, and
so the agent can signal a rank together with everything the rank spawned
(dataloader workers, compilers) with one killpg. Ranks get
PR_SET_PDEATHSIG=SIGKILL: if the agent itself is SIGKILLed, the kernel kills
the ranks, so nothing is orphaned even then. PDEATHSIG fires when the
*thread* that forked the child exits, so ranks are spawned from the main
thread, which lives as long as the agent; and they are all spawned before
any helper thread starts, because preexec_fn is not safe to run while other
threads may hold locks.
PDEATHSIG covers only the ranks themselves, not what they spawned; so the
agent also forks a tiny watchdog before anything else (see `_Watchdog`). The
agent tells it each rank's process group over a pipe (and, once a second,
the group of every orphan it adopted, see below); if the agent dies without
saying "done", the pipe reaches EOF and the watchdog SIGKILLs those groups,
grandchildren included, and removes the agent's heartbeat directory (see
[Note: hung ranks] in hang.py), which the agent removes itself otherwise.
Processes are only ever signalled by process group id, never by name. When
a rank's leader has exited, its group is killed once more to reap anything
it left behind; Linux does not reuse a pid while a group of that id still
has members, so this cannot hit an unrelated process group.
Once every rank exited, the agent deletes the NVMe offload swap directories
its ranks registered and did not remove themselves (a rank killed by a
signal cannot; see dsrun/runtime/offload/registry.py).
A daemon started by a rank (fork, setsid, fork again) leaves the rank's
group and session, so killpg cannot reach it. The agent is therefore a
child subreaper (PR_SET_CHILD_SUBREAPER): orphans of its ranks are
re-parented to the agent instead of to init, so they stay its descendants,
and when the last rank has exited the agent SIGKILLs every descendant it
still has (the watchdog excepted), by pid. Such a daemon may also hold the
rank's stdout or stderr open; the agent never waits for EOF on a pipe whose
writer is gone: once a rank has exited and its pipes hold no unread bytes,
its output is complete.

[Note: which exits are failures]
A rank that exits non-zero is reported (a `RankFailure` record for the
head's table) unless the agent itself ended it: an exit by a signal the
agent sent that rank (the SIGTERM of a teardown, a forwarded SIGINT, the
SIGKILL after the grace period) is the teardown, not a failure. A rank
ended by any other signal is always reported, also once a teardown has
begun: a rank SIGKILLed by the OOM killer must be in the table even when a
peer's error about it reached the agent first and started the teardown
(which rank a poll sees dead first depends on scheduling). A rank that
exits with a non-zero code is reported while no teardown is under way, or
once this node has a failure of its own; during a teardown started from
outside (Ctrl-C, the head stopping every node) a rank whose signal handler
exits with a code is the stop taking effect. The order of the records does
not matter: the root cause is chosen by `failure.by_root_cause`.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import BinaryIO

from dsrun.env import HEARTBEAT_FILE
from dsrun.launcher.env import rank_argv, rank_process_env
from dsrun.launcher.failure import RankFailure, StderrTail, by_root_cause, exit_status, signal_name
from dsrun.launcher.hang import HANG_EXIT_CODE, HANG_REASON, HangReport, HangWatch, likely_causes
from dsrun.launcher.job import InvalidNodeJob, NodeJob
from dsrun.launcher.proctree import EXITED, children_map, descendants
from dsrun.runtime.offload import registry

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# Loaded in the parent: the child between fork and exec must not dlopen.
_LIBC = ctypes.CDLL(None, use_errno=True)
# How often the watch loop polls the ranks, seconds.
_POLL_S = 0.05
# How long to wait for a rank's output pipes to drain after it exited, seconds.
_DRAIN_S = 2.0
# How often exited orphans (re-parented to the agent, see [Note: agent process tree]) are reaped, seconds.
_REAP_S = 1.0
# Exit status when stdin reached EOF: like a SIGHUP ("the controlling side hung up").
EOF_EXIT = 128 + signal.SIGHUP


def control_line(signum: int | None = None, *, kill: bool = False, dump: bool = False) -> bytes:
    """A control line for an agent's stdin.

    ``control_line(signal.SIGINT)`` asks the agent to forward SIGINT to its
    ranks and SIGKILL them after the job's grace period;
    ``control_line(kill=True)`` asks it to SIGKILL them now;
    ``control_line(dump=True)`` asks it for a hang report of its ranks
    (stacks and last collectives, see [Note: hung ranks] in hang.py).
    """
    if dump:
        message = {"dump": True}
    else:
        message = {"kill": True} if kill else {"signal": signal.Signals(signum).name}
    return (json.dumps(message) + "\n").encode()


def _pdeathsig_setup(agent_pid: int):
    """preexec_fn for a rank: die with SIGKILL when the agent dies (see [Note: agent process tree])."""

    def setup() -> None:
        if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        # The agent may have died between fork and prctl; then no signal will come.
        if os.getppid() != agent_pid:
            os._exit(126)

    return setup


class _LineReader:
    """Lines from a file descriptor, read with os.read.

    Not a buffered file object: the control thread blocks in a read until
    the head goes away, and a daemon thread blocked inside a BufferedReader
    aborts the interpreter at shutdown; an os.read holds no Python lock.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending = b""

    def readline(self) -> bytes:
        """The next line including its newline; b"" at EOF."""
        while b"\n" not in self._pending:
            chunk = os.read(self._fd, 65536)
            if not chunk:
                line, self._pending = self._pending, b""
                return line
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line + b"\n"


def _unread_bytes(pipe: BinaryIO) -> int:
    """Bytes waiting in a pipe (FIONREAD); 0 once the pipe is closed."""
    try:
        count = ctypes.c_int(0)
        fcntl.ioctl(pipe.fileno(), termios.FIONREAD, count)
        return count.value
    except (OSError, ValueError):
        return 0


def kill_descendants(spare: set[int], timeout: float = 2.0) -> list[int]:
    """SIGKILL every descendant of this process except the pids in `spare`; returns the pids killed.

    Repeats until none is left (a process may fork while its siblings die)
    or `timeout` seconds passed. Zombies are skipped: they are already dead.
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = []
        for pid, state in descendants(os.getpid()):
            if pid in spare or state in EXITED:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            found.append(pid)
        if not found:
            break
        killed += found
        time.sleep(0.01)
    return killed


class _Watchdog:
    """A forked process that SIGKILLs the ranks' process groups if the agent dies abruptly,
    then removes the directory `leftover` (if given).

    See [Note: agent process tree]. Fork it before any thread starts.
    """

    def __init__(self, leftover: Path | None = None) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write_fd)
            _watchdog_main(read_fd, leftover)  # never returns
        os.close(read_fd)
        self.pid = pid
        self._fd = write_fd

    def guard(self, pgid: int) -> None:
        """Have the watchdog kill group `pgid` should the agent die."""
        os.write(self._fd, f"{pgid}\n".encode())

    def release(self) -> None:
        """The agent is finishing normally: let the watchdog exit without killing anything."""
        os.write(self._fd, b"done\n")
        os.close(self._fd)
        os.waitpid(self.pid, 0)


def _watchdog_main(fd: int, leftover: Path | None) -> None:
    # Detach from the agent's stdio, so the head's readers see EOF when the agent ends;
    # leave the agent's process group (a hard kill of it must not take the watchdog along)
    # and ignore the signals aimed at the agent: the watchdog must outlive it.
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(devnull, target)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    pgids, pending = [], b""
    while chunk := os.read(fd, 4096):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line == b"done":
                os._exit(0)
            pgids.append(int(line))
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    if leftover is not None:
        shutil.rmtree(leftover, ignore_errors=True)
    os._exit(0)


class _Rank:
    """One started rank process and what is captured from it."""

    def __init__(self, index: int, rank: int, local_rank: int, log: BinaryIO | None) -> None:
        self.index = index
        self.rank = rank
        self.local_rank = local_rank
        self.log = log
        self.log_lock = threading.Lock()
        self.tail = StderrTail()
        self.popen: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.signals_sent: set[int] = set()  # signals the agent sent the running rank (see _stopped_by_agent)
        self.pumps: list[threading.Thread] = []
        # Per pump thread: lines read so far, and whether it is inside readline (see Agent._drain).
        self.lines_read: dict[str, int] = {}
        self.reading: dict[str, bool] = {}

    def signal_group(self, signum: int) -> None:
        """Send `signum` to the rank's process group; a group that is gone is fine."""
        if self.returncode is None:
            self.signals_sent.add(signum)
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


class Agent:
    """Runs the ranks of one `NodeJob` until they all exit; see the module docstring."""

    def __init__(self, job: NodeJob, stdin: _LineReader, stdout: BinaryIO, stderr: BinaryIO) -> None:
        self.job = job
        self._stdin = stdin
        self._out = stdout
        self._err = stderr
        self._out_lock = threading.Lock()
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe in signal handlers
        self._ranks: list[_Rank] = []
        self._failures: list[RankFailure] = []
        self._stopping = False
        self._external_status: int | None = None
        self._kill_at: float | None = None
        self._hang: HangWatch | None = None
        self._hang_reported = False

    # ---- start -------------------------------------------------------------------------

    def run(self) -> int:
        """Start the ranks, watch them, tear down; returns the agent's exit status."""
        # Orphans of the ranks (daemons) become our children; see [Note: agent process tree].
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        try:
            self._hang = HangWatch.create(self.job)
        except OSError as exc:  # a diagnostic must not keep the job from running
            self._write(self._err, f"dsrun agent on {self.job.host}: no hang detection: cannot make the heartbeat "
                                   f"files ({exc}); set TMPDIR to a writable directory\n".encode())
        try:
            return self._run()
        finally:
            if self._hang is not None:
                self._hang.close()

    def _run(self) -> int:
        watchdog = _Watchdog(self._hang.directory if self._hang is not None else None)
        try:
            self._spawn_all(watchdog)
        except BaseException:
            watchdog.release()
            raise
        for rank in self._ranks:
            self._start_pumps(rank)
        threading.Thread(target=self._read_control, daemon=True, name="agent-stdin").start()
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, lambda s, _f: self._events.put(("signal", s)))
        self._watch(watchdog)
        kill_descendants(spare={watchdog.pid})
        for rank in self._ranks:
            self._drain(rank)
        watchdog.release()
        _reap_children()
        registry.remove_registered(self.job.job_id)  # swap files of ranks that could not remove them
        for rank in self._ranks:
            if rank.log is not None:
                with rank.log_lock:
                    rank.log.close()
        return self._exit_status()

    def _spawn_all(self, watchdog: _Watchdog) -> None:
        # Open every log before starting any rank, so a bad log_dir stops the job early.
        logs: list[BinaryIO | None] = [None] * len(self.job.ranks)
        if self.job.log_dir:
            log_dir = Path(self.job.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
            logs = [open(log_dir / f"rank_{r}.log", "wb") for r in self.job.ranks]
        for index, (rank_id, local_rank, log) in enumerate(zip(self.job.ranks, self.job.local_ranks, logs)):
            rank = _Rank(index, rank_id, local_rank, log)
            try:
                rank.popen = _popen(
                    rank_argv(self.job, index),
                    cwd=self.job.cwd,
                    env=rank_process_env(self.job, index, self._inherited_env(rank_id)),
                    preexec_fn=_pdeathsig_setup(os.getpid()),
                )
            except OSError as exc:
                # A bad interpreter path or cwd: report it like a rank failure.
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                rank.tail.add(f"dsrun agent: cannot start rank {rank_id}: {exc}")
                self._failures.append(self._record(rank, None, code, None))
                self._emit_record(self._failures[-1])
                for unused in logs[index:]:
                    if unused is not None:
                        unused.close()
                self._begin_stop(signal.SIGTERM)
                return
            watchdog.guard(rank.popen.pid)
            self._ranks.append(rank)

    def _inherited_env(self, rank_id: int) -> dict[str, str]:
        """The agent's environment as a rank inherits it: with the rank's own heartbeat file, or without
        any (a DSRUN_HEARTBEAT_FILE inherited from a dsrun that started this one must not reach it)."""
        env = {k: v for k, v in os.environ.items() if k != HEARTBEAT_FILE.name}
        return {**env, **self._hang.rank_env(rank_id)} if self._hang is not None else env

    def _start_pumps(self, rank: _Rank) -> None:
        for pipe, sink, keep_tail in ((rank.popen.stdout, self._out, False), (rank.popen.stderr, self._err, True)):
            thread = threading.Thread(
                target=self._pump, args=(rank, pipe, sink, keep_tail), daemon=True,
                name=f"pump-{rank.rank}-{'stderr' if keep_tail else 'stdout'}"
            )
            thread.start()
            rank.pumps.append(thread)

    # ---- output ------------------------------------------------------------------------

    def _pump(self, rank: _Rank, pipe: BinaryIO, sink: BinaryIO, keep_tail: bool) -> None:
        """Copy a rank's pipe line by line to `sink` with a ``[rank N]`` prefix, the log and the tail."""
        prefix = f"[rank {rank.rank}] ".encode()
        name = threading.current_thread().name
        while True:
            rank.reading[name] = True  # each pump writes its own keys
            raw = pipe.readline()
            rank.reading[name] = False
            rank.lines_read[name] = rank.lines_read.get(name, 0) + 1
            if not raw:
                break
            if not raw.endswith(b"\n"):
                raw += b"\n"
            self._write(sink, prefix + raw)
            if rank.log is not None:
                with rank.log_lock:
                    if not rank.log.closed:  # closed once the agent is done waiting for this pipe
                        rank.log.write(raw)
                        rank.log.flush()
            if keep_tail:
                rank.tail.add(raw.decode(errors="replace").rstrip("\r\n"))
        pipe.close()

    def _write(self, sink: BinaryIO, data: bytes) -> None:
        with self._out_lock:
            try:
                sink.write(data)
                sink.flush()
            except (BrokenPipeError, ValueError, OSError):
                # The head is gone; stdin EOF will stop the job. Keep draining the ranks.
                pass

    # ---- watch and tear down -------------------------------------------------------------

    def _read_control(self) -> None:
        """Turn control lines from the head into events; EOF means the head is gone."""
        for line in iter(self._stdin.readline, b""):
            try:
                message = json.loads(line)
                if message.get("kill"):
                    self._events.put(("kill", None))
                elif message.get("dump"):
                    self._events.put(("dump", None))
                elif "signal" in message:
                    self._events.put(("signal", signal.Signals[message["signal"]]))
            except (ValueError, AttributeError, KeyError):
                continue  # not a control line we know; keep listening for the ones we do
        self._events.put(("eof", None))

    def _watch(self, watchdog: _Watchdog) -> None:
        next_reap, guarded = time.monotonic() + _REAP_S, {r.popen.pid for r in self._ranks}
        while True:
            if time.monotonic() >= next_reap:  # zombies of orphans must not pile up over a long job
                adopted = _adopted_groups(spare={watchdog.pid, *(r.popen.pid for r in self._ranks)})
                for pgid in adopted - guarded:  # should the agent be SIGKILLed, the watchdog kills them too
                    watchdog.guard(pgid)
                guarded |= adopted
                next_reap = time.monotonic() + _REAP_S
            newly_failed = []
            for rank in self._running():
                returncode = rank.popen.poll()
                if returncode is None:
                    continue
                rank.returncode = returncode
                rank.signal_group(signal.SIGKILL)  # whatever the rank left behind in its group
                if self._failed_on_its_own(rank):
                    newly_failed.append(rank)
            if newly_failed:
                self._begin_stop(signal.SIGTERM)  # stop the others first, then collect the report
                for rank in newly_failed:
                    self._drain(rank)
                for rank in newly_failed:
                    failure = self._record(rank, rank.popen.pid, exit_status(rank.returncode), signal_name(rank.returncode))
                    self._failures.append(failure)
                    self._emit_record(failure)
            running = self._running()
            if not running:
                break
            if self._hang is not None and not self._stopping:
                hung = self._hang.stalled(r.rank for r in running)
                if hung:
                    self._on_hang(hung)
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                for rank in running:
                    rank.signal_group(signal.SIGKILL)
                self._kill_at = None
            try:
                kind, value = self._events.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            self._on_event(kind, value)

    def _on_event(self, kind: str, value) -> None:
        if kind == "dump":
            self._emit_hang_report([])
            return
        if kind == "kill":
            for rank in self._running():
                rank.signal_group(signal.SIGKILL)
            return
        if self._external_status is None and not self._failures:
            self._external_status = EOF_EXIT if kind == "eof" else 128 + value
        forwarded = value if kind == "signal" and value in (signal.SIGINT, signal.SIGTERM) else signal.SIGTERM
        self._begin_stop(forwarded)

    def _begin_stop(self, signum: int) -> None:
        """Send `signum` to every running rank's group and arm the SIGKILL deadline (once)."""
        if self._stopping:
            return
        self._stopping = True
        for rank in self._running():
            rank.signal_group(signum)
        self._kill_at = time.monotonic() + self.job.grace_period

    def _on_hang(self, hung: list[int]) -> None:
        """Report the ranks `hung` with every rank's state, fail them (the likely cause first), stop the job."""
        hung = self._emit_hang_report(hung)
        by_rank = {r.rank: r for r in self._ranks}
        for rank_id in hung:
            rank = by_rank[rank_id]
            failure = self._record(rank, rank.popen.pid, HANG_EXIT_CODE, None, reason=HANG_REASON)
            self._failures.append(failure)
            self._emit_record(failure)
        self._begin_stop(signal.SIGTERM)

    def _emit_hang_report(self, hung: list[int]) -> list[int]:
        """Write the hang report of this node's running ranks on stderr (once; nothing without hang
        detection); returns `hung` with the likely causes (hang.likely_causes) first."""
        if self._hang is None or self._hang_reported:
            return hung
        self._hang_reported = True
        snapshots = self._hang.snapshot({r.rank: r.popen.pid for r in self._running()})
        causes = likely_causes(snapshots)
        hung = sorted(hung, key=lambda rank: rank not in causes)  # stable: otherwise longest silent first
        report = HangReport(host=self.job.host, node_rank=self.job.node_rank, timeout=self.job.hang_timeout,
                            time=time.time(), hung=hung, ranks=snapshots)
        self._write(self._err, (report.to_line() + "\n").encode())
        return hung

    def _failed_on_its_own(self, rank: _Rank) -> bool:
        """Whether an exited rank goes into the failure report: see [Note: which exits are failures]."""
        if rank.returncode == 0 or -rank.returncode in rank.signals_sent:
            return False
        if any(failure.rank == rank.rank for failure in self._failures):
            return False  # already reported (found hung, then its handler exited on the teardown's signal)
        return rank.returncode < 0 or not self._stopping or bool(self._failures)

    def _running(self) -> list[_Rank]:
        return [r for r in self._ranks if r.returncode is None]

    @staticmethod
    def _drain(rank: _Rank) -> None:
        """Wait until the output of an exited rank is relayed: its pumps reached EOF, or for _POLL_S its
        pipes held no unread byte while every live pump sat in readline without progress (waiting for
        input that will never come: a descendant keeps the pipe open, which must not delay the job),
        or _DRAIN_S passed."""
        deadline = time.monotonic() + _DRAIN_S
        pipes = (rank.popen.stdout, rank.popen.stderr)
        seen, still_since = None, time.monotonic()
        while any(t.is_alive() for t in rank.pumps) and time.monotonic() < deadline:
            busy = any(_unread_bytes(p) for p in pipes) or not all(
                rank.reading.get(t.name) for t in rank.pumps if t.is_alive())
            now = dict(rank.lines_read)
            if now != seen or busy:
                seen, still_since = now, time.monotonic()
            elif time.monotonic() - still_since > _POLL_S:
                return
            time.sleep(0.005)

    # ---- report --------------------------------------------------------------------------

    def _record(self, rank: _Rank, pid: int | None, code: int, sig: str | None,
                reason: str | None = None) -> RankFailure:
        return RankFailure(
            host=self.job.host,
            node_rank=self.job.node_rank,
            rank=rank.rank,
            local_rank=rank.local_rank,
            pid=pid,
            exit_code=code,
            signal=sig,
            stderr_tail=rank.tail.lines(),
            traceback=rank.tail.traceback(),
            time=time.time(),
            reason=reason,
        )

    def _emit_record(self, failure: RankFailure) -> None:
        self._write(self._err, (failure.to_line() + "\n").encode())

    def _exit_status(self) -> int:
        if self._failures:
            return by_root_cause(self._failures)[0].exit_code
        if self._external_status is not None:
            return self._external_status
        return next((exit_status(r.returncode) for r in self._ranks if r.returncode != 0), 0)


def _adopted_groups(spare: set[int]) -> set[int]:
    """Reap the exited children of the agent other than `spare` (the ranks, whose status Popen
    collects, and the watchdog); return the process groups of the live ones (orphans adopted as
    subreaper, see [Note: agent process tree])."""
    groups = set()
    for pid, state in children_map().get(os.getpid(), ()):
        try:
            if pid in spare:
                continue
            if state in EXITED:
                os.waitpid(pid, os.WNOHANG)
            else:
                groups.add(os.getpgid(pid))
        except (ProcessLookupError, ChildProcessError):
            continue
    return groups - {os.getpgrp()}


def _reap_children() -> None:
    """Collect the exit status of every child left (killed descendants re-parented to the agent)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _popen(argv: list[str], *, cwd: str, env: dict[str, str], preexec_fn) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )


def main() -> int:
    """Entry point of ``python -m dsrun.launcher.agent``."""
    stdin = _LineReader(sys.stdin.fileno())
    line = stdin.readline()
    if not line.strip():
        print("dsrun agent: expected a NodeJob as one JSON line on stdin, got nothing", file=sys.stderr)
        return 2
    try:
        job = NodeJob.from_json_line(line)
    except InvalidNodeJob as exc:
        print(f"dsrun agent: the NodeJob on stdin is invalid:\n{exc}", file=sys.stderr)
        return 2
    agent = Agent(job, stdin, sys.stdout.buffer, sys.stderr.buffer)
    try:
        return agent.run()
    except OSError as exc:
        # e.g. log_dir cannot be created: nothing has started, say why.
        print(f"dsrun agent on {job.host}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The head: starts one agent per node through a runner, relays output, tears the job down.

[Note: head and runners]
The head never touches rank processes. It talks to one agent per node
through an `AgentHandle`: the agent's stdout and stderr (byte streams of
lines), a way to write control lines to the agent's stdin (see
`agent.control_line`), poll() for the agent's exit status, and kill() to cut
the agent off hard. A `Runner` turns a `NodeJob` into a started handle: the
local runner spawns the agent as a subprocess; SSH and Slurm runners start
it on another host and map the same operations onto a channel or srun.
Because agents kill their ranks when their stdin reaches EOF, cutting the
transport is always a safe last resort.

Teardown order: the first rank failure (a record on an agent's stderr) or
agent failure makes the head send SIGTERM to every agent, which relay it
to their ranks and SIGKILL them after the job's grace period. A SIGINT or
SIGTERM to the head is forwarded the same way; a second one, or agents
still alive `grace_period + _KILL_MARGIN_S` later, gets the handles killed.
A rank failure with reason "hung" first makes the head ask every agent for
its hang report (see [Note: hung ranks] in hang.py).
"""
from __future__ import annotations

import collections
import queue
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from typing import BinaryIO

from rich.console import Console

from dsrun.launcher.agent import control_line
from dsrun.launcher.failure import AgentFailure, RankFailure, by_root_cause
from dsrun.launcher.hang import HANG_REASON, HangReport
from dsrun.launcher.job import NodeJob
from dsrun.launcher.progress import ProgressDisplay
from dsrun.launcher.summary import print_failure_summary

# Time an agent gets beyond the ranks' grace period to finish its own teardown, seconds.
_KILL_MARGIN_S = 5.0
_POLL_S = 0.05
# Lines of an agent's own stderr kept for the summary of a lost agent.
_AGENT_TAIL_LINES = 20
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class AgentHandle(ABC):
    """A started agent, as the head sees it (see [Note: head and runners])."""

    def __init__(self, job: NodeJob) -> None:
        self.job = job

    @property
    @abstractmethod
    def stdout(self) -> BinaryIO:
        """The agent's stdout: rank lines, already prefixed with ``[rank N]``."""

    @property
    @abstractmethod
    def stderr(self) -> BinaryIO:
        """The agent's stderr: prefixed rank lines and failure records."""

    @abstractmethod
    def poll(self) -> int | None:
        """The agent's shell-style exit status (128+N for signal N), or None while it runs."""

    @abstractmethod
    def send(self, data: bytes) -> None:
        """Write `data` to the agent's stdin; silently does nothing if the agent is gone."""

    @abstractmethod
    def kill(self) -> None:
        """Cut the agent off now (its ranks die with it: PDEATHSIG or stdin EOF)."""


class Runner(ABC):
    """Starts agents somewhere (a local subprocess, an SSH channel, srun)."""

    @abstractmethod
    def start(self, job: NodeJob) -> AgentHandle:
        """Start the agent for `job`, write the job to its stdin as one JSON line, and return its handle.

        Raises OSError (or a runner-specific error) when the agent cannot be started.
        """


class _AgentState:
    """What the head tracks per agent."""

    def __init__(self, handle: AgentHandle) -> None:
        self.handle = handle
        self.status: int | None = None
        self.failed_first = False  # exited non-zero before the head began a teardown
        self.tail: collections.deque[str] = collections.deque(maxlen=_AGENT_TAIL_LINES)
        self.pumps: list[threading.Thread] = []


class Head:
    """Runs a job of one or more `NodeJob`s through `runner`; `run()` returns dsrun's exit status."""

    def __init__(
        self,
        jobs: list[NodeJob],
        runner: Runner,
        console: Console,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
    ) -> None:
        if not jobs:
            raise ValueError("a job needs at least one node")
        self.jobs = jobs
        self.runner = runner
        self.console = console
        self._out = stdout or sys.stdout.buffer
        self._err = stderr or sys.stderr.buffer
        self._write_lock = threading.Lock()
        self._display = ProgressDisplay(self._out)  # rank 0's progress records (progress.py)
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe in signal handlers
        self._agents: list[_AgentState] = []
        self._failures: list[RankFailure] = []
        self._hangs: list[HangReport] = []  # see [Note: hung ranks] in hang.py
        self._stop_signal: int | None = None
        self._stopping = False
        self._kill_at: float | None = None

    @property
    def grace_period(self) -> float:
        """Longest SIGTERM-to-SIGKILL grace period among the nodes, seconds."""
        return max(job.grace_period for job in self.jobs)

    def run(self) -> int:
        """Start every agent, relay output until all have exited, print the summary on failure."""
        previous = {s: signal.signal(s, lambda signum, _f: self._events.put(("signal", signum))) for s in _FORWARDED_SIGNALS}
        try:
            for job in self.jobs:
                self._agents.append(_AgentState(self.runner.start(job)))
                self._start_pumps(self._agents[-1])
            self._watch()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self._agents and any(a.status is None for a in self._agents):
                # Unexpected exit of the head itself (e.g. a runner failed half-way): leave nothing behind.
                for agent in self._agents:
                    agent.handle.kill()
        self._display.stop()
        return self._report()

    # ---- output ------------------------------------------------------------------------

    def _start_pumps(self, agent: _AgentState) -> None:
        for target, stream in ((self._pump_stdout, agent.handle.stdout), (self._pump_stderr, agent.handle.stderr)):
            thread = threading.Thread(target=target, args=(agent, stream), daemon=True)
            thread.start()
            agent.pumps.append(thread)

    def _pump_stdout(self, agent: _AgentState, stream: BinaryIO) -> None:
        for line in iter(stream.readline, b""):
            if not self._display.consume(line):
                self._write(self._out, line)

    def _pump_stderr(self, agent: _AgentState, stream: BinaryIO) -> None:
        for line in iter(stream.readline, b""):
            text = line.decode(errors="replace").rstrip("\r\n")
            failure = RankFailure.from_line(text)
            if failure is not None:
                self._events.put(("failure", failure))
                continue
            hang = HangReport.from_line(text)
            if hang is not None:
                self._events.put(("hang", hang))
                continue
            agent.tail.append(text)
            self._write(self._err, line)

    def _write(self, sink: BinaryIO, line: bytes) -> None:
        with self._write_lock:
            self._display.write(sink, line)  # above the live progress bar, or as is

    # ---- watch and tear down -------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            for agent in self._agents:
                if agent.status is None:
                    agent.status = agent.handle.poll()
                    if agent.status not in (None, 0) and not self._stopping:
                        agent.failed_first = True
                        self._begin_stop(signal.SIGTERM)
            if all(a.status is not None for a in self._agents):
                break
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._kill_all()
            try:
                kind, value = self._events.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if kind == "hang":
                self._hangs.append(value)
            elif kind == "failure":
                if value.reason == HANG_REASON and not self._stopping:  # every node's stacks for the report
                    for agent in self._agents:
                        if agent.status is None:
                            agent.handle.send(control_line(dump=True))
                self._failures.append(value)
                self._begin_stop(signal.SIGTERM)
            elif self._stopping and self._stop_signal is not None:
                self._kill_all()  # a second signal: the user does not want to wait
            else:
                self._stop_signal = value
                self._begin_stop(signal.SIGTERM if value == signal.SIGHUP else value)
        for agent in self._agents:
            for thread in agent.pumps:
                thread.join(timeout=2.0)
        while True:  # records that arrived after the last poll
            try:
                kind, value = self._events.get_nowait()
            except queue.Empty:
                break
            if kind == "failure":
                self._failures.append(value)
            elif kind == "hang":
                self._hangs.append(value)

    def _begin_stop(self, signum: int) -> None:
        if self._stopping:
            return
        self._stopping = True
        for agent in self._agents:
            if agent.status is None:
                agent.handle.send(control_line(signum))
        self._kill_at = time.monotonic() + self.grace_period + _KILL_MARGIN_S

    def _kill_all(self) -> None:
        for agent in self._agents:
            if agent.status is None:
                agent.handle.kill()
        self._kill_at = None

    # ---- outcome -------------------------------------------------------------------------

    @property
    def stopped_by(self) -> int | None:
        """The signal (SIGINT, SIGTERM, SIGHUP) sent to dsrun that stopped the job, else None (after run())."""
        return self._stop_signal

    def first_failure(self) -> str | None:
        """One line naming what ended the job: the root-cause rank failure (see [Note: root cause order]
        in failure.py), else a node whose agent failed; None when nothing failed (after run())."""
        if self._failures:
            f = by_root_cause(self._failures)[0]
            how = f.signal or f"exit code {f.exit_code}"
            return f"rank {f.rank} on {f.host} ended with {how}"
        lost = next((a for a in self._agents if a.failed_first), None)
        if lost is not None:
            return f"node {lost.handle.job.host} was lost (agent exit status {lost.status})"
        return None

    def _report(self) -> int:
        """Print what went wrong (if anything) and return dsrun's exit status."""
        failures = by_root_cause(self._failures)
        failed_nodes = {f.node_rank for f in failures}
        lost = [
            AgentFailure(host=a.handle.job.host, node_rank=a.handle.job.node_rank, exit_code=a.status, output_tail=list(a.tail))
            for a in self._agents
            if a.failed_first and a.handle.job.node_rank not in failed_nodes
        ]
        job_id = self.jobs[0].job_id
        if failures or lost:
            print_failure_summary(self.console, job_id, failures, lost, self._hangs)
            return failures[0].exit_code if failures else lost[0].exit_code
        if self._stop_signal is not None:
            self.console.print(f"dsrun: job {job_id} stopped by {signal.Signals(self._stop_signal).name}")
            return 128 + self._stop_signal
        return next((a.status for a in self._agents if a.status), 0)


"""The local runner: the agent as a subprocess of the head (see [Note: head and runners] in head.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import BinaryIO

from dsrun.launcher.failure import exit_status
from dsrun.launcher.head import AgentHandle, Runner
from dsrun.launcher.job import NodeJob


class PopenAgentHandle(AgentHandle):
    """An agent reached through a local subprocess: the agent itself, or a transport such as srun.

    The subprocess leads its own session, so a terminal's Ctrl-C reaches only
    the head, and kill() can SIGKILL it with everything in its group.
    """

    def __init__(self, job: NodeJob, popen: subprocess.Popen) -> None:
        super().__init__(job)
        self.popen = popen

    @property
    def stdout(self) -> BinaryIO:
        return self.popen.stdout

    @property
    def stderr(self) -> BinaryIO:
        return self.popen.stderr

    def poll(self) -> int | None:
        returncode = self.popen.poll()
        return None if returncode is None else exit_status(returncode)

    def send(self, data: bytes) -> None:
        try:
            self.popen.stdin.write(data)
            self.popen.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # the agent already exited; poll() will say how

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def start_popen_agent(job: NodeJob, argv: list[str], env: dict[str, str] | None = None) -> PopenAgentHandle:
    """Start `argv` (which must run ``python -m dsrun.launcher.agent`` somewhere) and hand it `job`.

    The job is written as one JSON line and stdin is kept open: its EOF is
    how the agent learns that the head is gone. Raises OSError if `argv`
    cannot be executed.
    """
    popen = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=job.cwd,
        env=env,
        start_new_session=True,
    )
    handle = PopenAgentHandle(job, popen)
    handle.send(job.to_json_line().encode())
    return handle


class LocalRunner(Runner):
    """Runs the agent on this host with the head's Python interpreter."""

    def start(self, job: NodeJob) -> AgentHandle:
        return start_popen_agent(job, [sys.executable, "-m", "dsrun.launcher.agent"])

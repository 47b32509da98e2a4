"""Fixtures for the launcher tests: run `dsrun` as a real subprocess and find leftover processes.

Every launch gets a unique marker in its environment (DSRUN_TEST_MARKER);
ranks inherit it, so any process still carrying it after the launch ended
is a leak.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment carries `marker`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get("DSRUN_TEST_MARKER") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def assert_no_leftovers(marker: str, within: float = 3.0) -> None:
    """Fail if processes carrying `marker` are still alive `within` seconds from now (then kill them)."""
    deadline = time.monotonic() + within
    while True:
        left = marked_processes(marker)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for proc in left:
        proc.kill()  # by pid, only our own marked processes
    assert not left, f"processes of the job survived: {[(p.pid, p.cmdline()) for p in left]}"


class Launcher:
    """Runs `python -m dsrun.launcher.cli ...` in a temporary directory with a unique marker."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.marker = uuid.uuid4().hex
        self.env = {**os.environ, "DSRUN_TEST_MARKER": self.marker}
        # Ranks import nothing from the repo, but the agent must find dsrun even when not installed.
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "dsrun.launcher.cli", *args]

    def run(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args), cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


@pytest.fixture
def launcher(tmp_path: Path):
    launcher = Launcher(tmp_path)
    yield launcher
    assert_no_leftovers(launcher.marker)

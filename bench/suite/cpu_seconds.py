"""CPU-seconds of a command and of every process it starts, however deep.

    python bench/suite/cpu_seconds.py [--repeats N] -- .venv/bin/python -m pytest -q tests/faults/test_restarts.py

On a shared machine the wall time of a test says more about the other jobs
than about the test; user + system CPU time does not (a test that waits on a
timer costs none). `/usr/bin/time` misses what pytest's children leave
behind: the forkserver of tests/dist_helpers.py and the ranks it forks, the
launcher's daemons, anything re-parented to init. This script makes itself
a child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER), so every orphaned
descendant is re-parented to it and reaped here, and RUSAGE_CHILDREN then
counts every process of the tree once. It waits up to --linger seconds for
descendants still running after the command ends (the forkserver exits
when pytest's pipe to it closes).

Prints one line per repeat (CPU-s, user, system, wall, exit status) and, for
several repeats, the minimum and median CPU-s. Compare two trees by
alternating them (A B A B) in one session, not by figures from different
hours.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def _reap_all(linger: float) -> None:
    """Wait for every remaining descendant (re-parented here), for at most `linger` seconds."""
    deadline = time.monotonic() + linger
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.1)
    print(f"cpu_seconds: descendants still running after {linger} s are not counted", file=sys.stderr)


def measure(cmd: list[str], linger: float) -> tuple[float, float, float, float, int]:
    """(CPU-s, user s, system s, wall s, exit status) of one run of `cmd` and all its descendants."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    rc = subprocess.call(cmd)
    _reap_all(linger)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return user + system, user, system, time.monotonic() - start, rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--linger", type=float, default=60.0, help="seconds to wait for leftover descendants")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    a = p.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("give the command to measure after --")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        p.error("prctl(PR_SET_CHILD_SUBREAPER) failed: this needs Linux")
    cpus, status = [], 0
    for i in range(a.repeats):
        cpu, user, system, wall, rc = measure(cmd, a.linger)
        cpus.append(cpu)
        status = status or rc
        print(f"run {i + 1}: CPU-s {cpu:.3f} (user {user:.3f}, system {system:.3f}), wall {wall:.1f} s, "
              f"exit {rc}", file=sys.stderr)
    if a.repeats > 1:
        print(f"CPU-s min {min(cpus):.3f} median {statistics.median(cpus):.3f} max {max(cpus):.3f}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""The node agent's own process tree, read from Linux's /proc.

[Note: no psutil in the agent]
The agent starts once per node and job, so its imports are paid on every
node of every launch (bench/launcher/node_cost.py). It needs only two
answers about processes: its children (to reap adopted orphans, see [Note:
agent process tree] in agent.py) and all its descendants (to SIGKILL what is
left at teardown). psutil gave both, and importing it cost about 20 ms CPU
per node, a third of the agent's imports. Both answers come from one pass
over /proc/<pid>/stat here, which is what psutil's `children()` itself does
on Linux (the kernel's per-task `children` file needs CONFIG_PROC_CHILDREN,
which not every kernel has). The agent runs on Linux only (it uses prctl).
"""
from __future__ import annotations

import os

# /proc/<pid>/stat states of a process that has exited (zombie, dead): nothing to signal.
EXITED = frozenset({"Z", "X", "x"})


def _stat(pid: str) -> tuple[int, str] | None:
    """(parent pid, state letter) of process `pid`, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = data[data.rindex(b")") + 2:].split(None, 2)
    return int(fields[1]), fields[0].decode()


def children_map() -> dict[int, list[tuple[int, str]]]:
    """parent pid -> [(pid, state letter)] of every process on this machine (one pass over /proc)."""
    tree: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(name)
            if stat is not None:
                tree.setdefault(stat[0], []).append((int(name), stat[1]))
    return tree


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every descendant of process `pid` as (pid, state letter), parents before their children.

    A snapshot: a process may start or exit while /proc is read.
    """
    tree = children_map()
    found, frontier = [], [pid]
    while frontier:
        kids = [kid for parent in frontier for kid in tree.get(parent, ())]
        found += kids
        frontier = [kid for kid, _ in kids]
    return found

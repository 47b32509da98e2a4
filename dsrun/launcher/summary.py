"""The failure summary the head prints: who failed, how, and the root cause's traceback."""
from __future__ import annotations

import datetime
import signal

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dsrun.launcher.failure import AgentFailure, RankFailure
from dsrun.launcher.hang import HANG_REASON, HangReport, RankSnapshot, likely_causes
from dsrun.runtime.observability.exit_report import CONFIG_ERROR_EXIT_CODE

# What a signal usually means for a training rank.
_SIGNAL_HINTS = {
    signal.SIGKILL: "likely out of memory (see `dmesg` for the OOM killer) or killed by a scheduler",
    signal.SIGSEGV: "segmentation fault in native code (an extension, a driver, or a corrupt tensor)",
    signal.SIGABRT: "aborted by native code (a failed C++ assertion or std::terminate)",
    signal.SIGBUS: "bus error: often /dev/shm too small for shared memory",
    signal.SIGFPE: "arithmetic fault in native code",
    signal.SIGILL: "illegal instruction: a binary built for another CPU",
    signal.SIGTERM: "terminated from outside (a scheduler time limit, or kill)",
    signal.SIGINT: "interrupted",
}
# What a few well-known exit codes mean.
_EXIT_HINTS = {
    126: "command could not be executed (permissions)",
    127: "command not found (check the Python path on that node)",
    CONFIG_ERROR_EXIT_CODE: "invalid dsrun config (message below)",
}


def describe(failure: RankFailure) -> str:
    """One line saying how a rank ended, with a hint where the cause is usually the same."""
    if failure.reason == HANG_REASON:
        return "hung: no progress (heartbeat) within --hang_timeout; stacks below"
    if failure.signal is not None:
        try:
            hint = _SIGNAL_HINTS.get(signal.Signals[failure.signal])
        except KeyError:
            hint = None
        return f"{failure.signal}: {hint}" if hint else failure.signal
    if failure.exit_code in _EXIT_HINTS:
        return _EXIT_HINTS[failure.exit_code]
    if failure.exit_code == 2 and any("unrecognized arguments" in line and "--local_rank" in line
                                      for line in failure.stderr_tail):
        return ("the script's argument parser rejects --local_rank, which dsrun appends as DeepSpeed's "
                "launcher does: pass --no_local_rank to dsrun, or accept it in the script "
                "(parser.add_argument('--local_rank', type=int, default=-1))")
    if failure.traceback is not None:
        return "Python exception (traceback below)"
    return f"exited with code {failure.exit_code}"


def print_failure_summary(
    console: Console, job_id: str, failures: list[RankFailure], lost_agents: list[AgentFailure],
    hangs: list[HangReport] = (),
) -> None:
    """Print the table of failed ranks and lost agents, then the root cause's stderr, then the hang reports.

    `failures` are in `failure.by_root_cause` order; the first is the root
    cause (the others failed before the teardown reached them, most of them
    because they lost that rank). The traceback is printed
    unwrapped, so it can be copied and searched. `hangs` are the agents'
    reports of a hang (see [Note: hung ranks] in hang.py), printed with
    every rank's last collective and stacks.
    """
    table = Table(title=f"dsrun: job {job_id} failed", title_justify="left", show_lines=False)
    for column in ("rank", "node", "pid", "exit", "cause"):
        table.add_column(column, overflow="fold")
    for index, failure in enumerate(failures):
        table.add_row(
            str(failure.rank),
            f"{failure.host} (node {failure.node_rank})",
            str(failure.pid) if failure.pid is not None else "-",
            str(failure.exit_code),
            ("root cause: " if index == 0 else "") + describe(failure),
        )
    for lost in lost_agents:
        table.add_row("-", f"{lost.host} (node {lost.node_rank})", "-", str(lost.exit_code), "agent failed (output below)")
    console.print(table)

    if failures and failures[0].reason != HANG_REASON:
        root = failures[0]
        console.print(Text(f"Root cause: rank {root.rank} on {root.host} ({describe(root)}); its stderr ends with:"))
        text = root.traceback if root.traceback is not None else "\n".join(root.stderr_tail) or "(no output on stderr)"
        console.print(Text(text), soft_wrap=True)
    if hangs:
        print_hang_reports(console, hangs)
    for lost in lost_agents:
        console.print(Text(f"Agent on {lost.host} (node {lost.node_rank}) exited with {lost.exit_code}; its output ends with:"))
        console.print(Text("\n".join(lost.output_tail) or "(no output)"), soft_wrap=True)


def _clock(wall: float) -> str:
    """A wall time as local HH:MM:SS.mmm."""
    return datetime.datetime.fromtimestamp(wall).strftime("%H:%M:%S.%f")[:-3]


def describe_rank_state(snap: RankSnapshot, now: float) -> str:
    """One line: how long a rank has been silent, its step, and its last collective (op, group, bytes, when).

    `now` is the report's wall time, to say how long the rank has been inside its collective.
    """
    if snap.beats == 0:
        parts = ["no heartbeat yet (still starting up)"]
    else:
        parts = [f"last heartbeat {snap.silent_s:.1f} s ago" if snap.silent_s is not None else "beating"]
    if snap.step is not None:
        parts.append(f"step {snap.step}")
    call = snap.collective
    if call is None:
        parts.append("no collective yet")
    else:
        what = f"{call.op} #{call.seq} over {call.group_size} rank(s), {call.bytes:,} B, entered {_clock(call.entered)}"
        if call.finished is None:
            parts.append(f"inside {what} for {max(0.0, now - call.entered):.1f} s")
        else:
            parts.append(f"last collective {what}, finished {_clock(call.finished)}")
    return "; ".join(parts)


def print_hang_reports(console: Console, hangs: list[HangReport]) -> None:
    """Print every rank's state and stacks from the agents' hang reports, the likely cause first."""
    hung = sorted({rank for report in hangs for rank in report.hung})
    timeout = max(report.timeout for report in hangs)
    console.print(Text(f"Hang: rank(s) {', '.join(map(str, hung)) or '?'} made no progress for {timeout:g} s "
                       "(--hang_timeout). Every rank's state:"))
    snapshots = sorted(((report, snap) for report in hangs for snap in report.ranks), key=lambda p: p[1].rank)
    for report, snap in snapshots:
        console.print(Text(f"  rank {snap.rank} on {report.host} (pid {snap.pid}): "
                           f"{describe_rank_state(snap, report.time)}"), soft_wrap=True)
    causes = likely_causes([snap for _, snap in snapshots])
    if causes:
        console.print(Text(f"Likely cause: rank(s) {', '.join(map(str, causes))}: not in, or behind, the collective "
                           "the others wait in (see their stacks)."))
    for report, snap in snapshots:
        console.print(Text(f"Stacks of rank {snap.rank} on {report.host} (pid {snap.pid}):"))
        console.print(Text(snap.stacks or "(none: the rank had not started dsrun's heartbeat, or did not answer "
                                          "in time)"), soft_wrap=True)

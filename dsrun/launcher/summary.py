"""The failure summary the head prints: who failed, how, and the root cause's traceback."""
from __future__ import annotations

import signal

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dsrun.launcher.failure import AgentFailure, RankFailure
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
    console: Console, job_id: str, failures: list[RankFailure], lost_agents: list[AgentFailure]
) -> None:
    """Print the table of failed ranks and lost agents, then the root cause's stderr.

    `failures` are ordered by time; the first is the root cause (the others
    failed before the teardown reached them). The traceback is printed
    unwrapped, so it can be copied and searched.
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

    if failures:
        root = failures[0]
        console.print(Text(f"Root cause: rank {root.rank} on {root.host} ({describe(root)}); its stderr ends with:"))
        text = root.traceback if root.traceback is not None else "\n".join(root.stderr_tail) or "(no output on stderr)"
        console.print(Text(text), soft_wrap=True)
    for lost in lost_agents:
        console.print(Text(f"Agent on {lost.host} (node {lost.node_rank}) exited with {lost.exit_code}; its output ends with:"))
        console.print(Text("\n".join(lost.output_tail) or "(no output)"), soft_wrap=True)

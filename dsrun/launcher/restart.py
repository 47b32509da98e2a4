"""Restarting a failed job: `dsrun --max_restarts N [--min_nodes A] [--max_nodes B]`.

[Note: restarts]
Each attempt is an ordinary launch (one `Head.run()`): the first rank
failure ends the whole attempt cleanly, as without restarts. What happens
then is decided here, in `run_with_restarts`:

- success (exit status 0): dsrun exits 0.
- the user stopped the job (SIGINT, SIGTERM or SIGHUP to dsrun, Ctrl-C
  between attempts included): never restarted; dsrun exits 128+N.
- a rank reported a user error (exit code 2, argparse's and click's usage
  error, or 78, an invalid dsrun config): never restarted, since the next
  attempt would fail the same way.
- any other failure, with restarts left: the job is started again, its
  ranks seeing DSRUN_RESTART_COUNT (and torchrun's TORCHELASTIC_RESTART_COUNT)
  = k on the k-th restart (0 on the first run).

Before every attempt, each restart included, the hosts are checked again
from the full selection (so a host dropped earlier that answers again
rejoins): the launch callback raises `HostsDown` naming each host that
failed its pre-check (for SSH: connection, host key, login, Python and
dsrun on the node, the master address; see ssh.prepare_ssh_launch) before
anything starts; those hosts are dropped, each named with its reason, and
the launch is tried on the rest. At most `max_nodes` hosts are used, the
first healthy ones in hostfile order; fewer than `min_nodes` ends the job
with the last attempt's status (or, on the first attempt, the check's
error). `min_nodes` unset means: on the first attempt every host it asks
for (a launch without restarts behaves exactly as before: any host that
fails the check stops the launch with the launcher's own report) and 1 on
a restart.

The rendezvous port of a restart is fresh or reusable: the previous
attempt's ranks have all exited when its `Head.run()` returns, so their
port is free again (bound with SO_REUSEADDR, TIME_WAIT does not block it);
where something else took it meanwhile, the launch callback picks another
(multinode.py).

Each restart runs under its own job id, the first attempt's with
`-restart<k>` appended (`attempt_job_id`): DSRUN_JOB_ID names the ranks'
shared-memory segments and swap files, and a rank killed by a signal
cannot remove its own, so a restart must never meet them under its name.

The exit status is 0 if some attempt succeeded, else the last failure's.
Each restart prints one line: attempt k/N, the reason, the hosts.

This is torchrun's elastic agent (`--max-restarts`, `--nnodes MIN:MAX`)
without a rendezvous service: the launcher itself knows the hosts and
decides the next attempt's world; the training script's checkpoints
(`"checkpoint": {"auto_resume": true, ...}`, docs/restarts.md) carry the
state across attempts, resharded to the new world size.
"""
from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console

from dsrun.runtime.observability.exit_report import CONFIG_ERROR_EXIT_CODE

# Exit codes of a rank that say the user's input is wrong: a restart would fail the same way.
USER_ERROR_EXIT_CODES = {2: "a usage error (bad script arguments)", CONFIG_ERROR_EXIT_CODE: "an invalid dsrun config"}


@dataclass(frozen=True)
class RestartPolicy:
    """How often and on how many hosts a failed job is started again.

    Attributes:
        max_restarts: restarts after the first attempt (0: never restart).
        min_nodes: fewest hosts an attempt may run on; None: on the first
            attempt every host it asks for (`max_nodes` of them), 1 on a restart.
        max_nodes: most hosts an attempt runs on (the first healthy ones in
            hostfile order); None: every host.
    """

    max_restarts: int = 0
    min_nodes: int | None = None
    max_nodes: int | None = None

    def check(self, num_hosts: int) -> None:
        """Raise ValueError (naming the option and the fix) for a policy that
        cannot be met with `num_hosts` selected hosts."""
        if self.max_restarts < 0:
            raise ValueError(f"--max_restarts {self.max_restarts}: give 0 (no restart) or more")
        for name, value in (("--min_nodes", self.min_nodes), ("--max_nodes", self.max_nodes)):
            if value is not None and value < 1:
                raise ValueError(f"{name} {value}: give 1 or more")
        if self.min_nodes is not None and self.max_nodes is not None and self.min_nodes > self.max_nodes:
            raise ValueError(f"--min_nodes {self.min_nodes} is more than --max_nodes {self.max_nodes}; "
                             "give a minimum no larger than the maximum")
        if self.min_nodes is not None and self.min_nodes > num_hosts:
            raise ValueError(f"--min_nodes {self.min_nodes} but only {num_hosts} host(s) are selected; "
                             "lower --min_nodes or add hosts to the hostfile")

    def fewest(self, attempt: int, num_hosts: int) -> int:
        """The fewest hosts attempt `attempt` (0 = first run) may run on, of `num_hosts` selected."""
        if self.min_nodes is not None:
            return self.min_nodes
        return self.most(num_hosts) if attempt == 0 else 1

    def most(self, num_hosts: int) -> int:
        """The most hosts an attempt runs on, of `num_hosts` selected."""
        return num_hosts if self.max_nodes is None else min(self.max_nodes, num_hosts)


@dataclass(frozen=True)
class AttemptResult:
    """How one attempt ended.

    Attributes:
        status: dsrun's exit status for it (0: success; 128+N: signal N).
        stopped_by: the signal number sent to dsrun that stopped it, else None.
        reason: one line naming what failed first (None on success).
    """

    status: int
    stopped_by: int | None = None
    reason: str | None = None


class HostsDown(Exception):
    """Raised by a launch callback before anything started: these hosts failed the pre-check.

    Attributes:
        failures: host -> why it cannot be used (one line each).
        original: the launcher's own error, re-raised when hosts may not be
            dropped (a first attempt without --min_nodes), so the user sees
            the same report as without restarts.
    """

    def __init__(self, failures: dict[str, str], original: BaseException | None = None) -> None:
        super().__init__("; ".join(f"{h}: {why}" for h, why in failures.items()))
        self.failures = failures
        self.original = original


class NotEnoughHosts(Exception):
    """Too few hosts passed the pre-check for the policy's minimum."""


# The launch callback: (restart count, hosts in node order, the line to print before starting) -> result.
Launch = Callable[[int, list[str], str | None], AttemptResult]


def attempt_job_id(job_id: str, restart: int) -> str:
    """The job id of restart `restart` (0: the first run, `job_id` itself); see [Note: restarts]."""
    return job_id if restart == 0 else f"{job_id}-restart{restart}"


def restart_line(attempt: int, max_restarts: int, reason: str | None, hosts: list[str]) -> str | None:
    """The line printed before restart `attempt` on `hosts` (None before the first run)."""
    if attempt == 0:
        return None
    return f"dsrun: restart {attempt}/{max_restarts} after {reason}: on {len(hosts)} host(s): {', '.join(hosts)}"


def restart_refusal(result: AttemptResult) -> str | None:
    """Why a failed attempt must not be restarted whatever the policy, or None if it may be."""
    if result.stopped_by is not None:
        return f"stopped by {signal.Signals(result.stopped_by).name}"
    if result.status in USER_ERROR_EXIT_CODES:
        return f"exit status {result.status} is {USER_ERROR_EXIT_CODES[result.status]}"
    return None


def launch_on_healthy_hosts(policy: RestartPolicy, hosts: list[str], attempt: int, launch: Launch,
                            header: Callable[[list[str]], str | None], console: Console) -> AttemptResult:
    """Run attempt `attempt` on the first healthy hosts of `hosts` (see [Note: restarts]).

    Calls `launch` on the first `policy.most` candidates; on `HostsDown`
    drops the named hosts (printing each with its reason) and tries again
    with the next candidates.

    Raises:
        NotEnoughHosts: fewer than `policy.fewest` hosts remain.
        The launcher's own error (`HostsDown.original`): a host failed on a
            first attempt that may not drop hosts.
    """
    fewest, most = policy.fewest(attempt, len(hosts)), policy.most(len(hosts))
    candidates = list(hosts)
    while True:
        chosen = candidates[:most]
        if len(chosen) < fewest:
            raise NotEnoughHosts(f"only {len(chosen)} host(s) passed the pre-check "
                                 f"({', '.join(chosen) or 'none'}), fewer than the {fewest} required"
                                 + ("" if policy.min_nodes is not None else " (lower it with --min_nodes)"))
        try:
            return launch(attempt, chosen, header(chosen))
        except HostsDown as down:
            if attempt == 0 and policy.min_nodes is None and down.original is not None:
                raise down.original from None
            for host, why in down.failures.items():
                console.print(f"dsrun: dropping host {host}: {why}", soft_wrap=True)
            dropped = set(down.failures)
            if not dropped & set(chosen):
                raise RuntimeError(f"the launcher reported hosts {sorted(dropped)} down, none of which "
                                   f"it was asked to use ({chosen})") from down
            candidates = [h for h in candidates if h not in dropped]


def run_with_restarts(policy: RestartPolicy, hosts: list[str], launch: Launch, console: Console) -> int:
    """Run the job, restarting it after failures as `policy` allows; returns dsrun's exit status.

    Args:
        hosts: the selected hosts in node order (the hostfile's after
            --include/--exclude/--num_nodes; ["localhost"] for a local launch).
        launch: starts one attempt; its first argument is the restart count
            (0 on the first run), its second the hosts to use, its third the
            line to print before it starts (None on the first attempt). It
            raises `HostsDown` if hosts fail its pre-check, before anything
            starts.

    Raises:
        ValueError: the policy cannot be met (see `RestartPolicy.check`).
        NotEnoughHosts: fewer than --min_nodes hosts passed the first
            attempt's pre-check (nothing was started).
        The launcher's own error for a failed pre-check of a first attempt
            that may not drop hosts (as without restarts).
    """
    policy.check(len(hosts))
    attempt, reason = 0, None
    result: AttemptResult | None = None
    try:
        while True:
            header = functools.partial(restart_line, attempt, policy.max_restarts, reason)
            try:
                result = launch_on_healthy_hosts(policy, hosts, attempt, launch, header, console)
            except NotEnoughHosts as exc:
                if result is None:  # the first attempt: nothing ran, so there is no status to return
                    raise NotEnoughHosts(f"{exc}; nothing was started") from None
                console.print(f"dsrun: cannot restart: {exc}; the job ends")
                return result.status
            if result.status == 0:
                if attempt:
                    console.print(f"dsrun: the job succeeded after {attempt} restart(s)")
                return 0
            refusal = restart_refusal(result)
            if policy.max_restarts and refusal is not None:
                console.print(f"dsrun: not restarting: {refusal}")
                return result.status
            if attempt >= policy.max_restarts:
                if policy.max_restarts:
                    console.print(f"dsrun: no restart left ({policy.max_restarts} used); the job ends "
                                  f"with exit status {result.status}")
                return result.status
            attempt += 1
            reason = result.reason or f"exit status {result.status}"
    except KeyboardInterrupt:  # Ctrl-C between attempts (during one, the head handles it)
        console.print("dsrun: interrupted between attempts; not restarting")
        return 128 + signal.SIGINT

"""The restart loop of `dsrun --max_restarts` (dsrun/launcher/restart.py) against a scripted launch callback:
which attempts run, on which hosts, with which restart count, and which exit status dsrun returns."""
from __future__ import annotations

import io
import signal

import pytest
from click.testing import CliRunner
from rich.console import Console

from dsrun.launcher.cli import cli
from dsrun.launcher.restart import (
    AttemptResult,
    HostsDown,
    NotEnoughHosts,
    RestartPolicy,
    run_with_restarts,
)


class Script:
    """A launch callback that plays back `outcomes` (an AttemptResult, or hosts -> HostsDown) and records calls."""

    def __init__(self, *outcomes) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[tuple[int, list[str], str | None]] = []

    def __call__(self, restart: int, hosts: list[str], header: str | None) -> AttemptResult:
        self.calls.append((restart, hosts, header))
        outcome = self.outcomes.pop(0)
        if callable(outcome):
            outcome = outcome(hosts)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def down(**why: str):
    """An outcome: the hosts named in `why` fail the pre-check when asked for."""
    def check(hosts: list[str]):
        failed = {h: w for h, w in why.items() if h in hosts}
        return HostsDown(failed, original=RuntimeError(f"pre-check failed on {sorted(failed)}"))
    return check


def run(policy: RestartPolicy, hosts: list[str], script: Script) -> tuple[int, str]:
    out = io.StringIO()
    status = run_with_restarts(policy, hosts, script, Console(file=out, width=300))
    return status, out.getvalue()


FAIL = AttemptResult(137, None, "rank 2 on b ended with SIGKILL")


def test_no_restart_by_default_returns_the_failure():
    script = Script(AttemptResult(3, None, "rank 1 on a ended with exit code 3"))
    status, out = run(RestartPolicy(), ["a"], script)
    assert status == 3 and [c[0] for c in script.calls] == [0]
    assert out == ""  # without restarts dsrun says nothing more than before


def test_restarts_until_success_with_counts_and_one_line_each():
    script = Script(FAIL, AttemptResult(1, None, "rank 0 on a ended with exit code 1"), AttemptResult(0))
    status, out = run(RestartPolicy(max_restarts=3), ["a", "b"], script)
    assert status == 0
    assert [(c[0], c[1]) for c in script.calls] == [(0, ["a", "b"]), (1, ["a", "b"]), (2, ["a", "b"])]
    assert script.calls[0][2] is None
    assert script.calls[1][2] == "dsrun: restart 1/3 after rank 2 on b ended with SIGKILL: on 2 host(s): a, b"
    assert script.calls[2][2].startswith("dsrun: restart 2/3 after rank 0 on a ended with exit code 1")
    assert "succeeded after 2 restart(s)" in out


def test_out_of_restarts_returns_the_last_failure():
    script = Script(AttemptResult(3, None, "x"), AttemptResult(5, None, "y"))
    status, out = run(RestartPolicy(max_restarts=1), ["a"], script)
    assert status == 5 and len(script.calls) == 2
    assert "no restart left" in out


@pytest.mark.parametrize("result,why", [
    (AttemptResult(130, signal.SIGINT, "rank 0 on a ended with SIGINT"), "stopped by SIGINT"),
    (AttemptResult(143, signal.SIGTERM, None), "stopped by SIGTERM"),
    (AttemptResult(2, None, "rank 0 on a ended with exit code 2"), "usage error"),
    (AttemptResult(78, None, "rank 0 on a ended with exit code 78"), "invalid dsrun config"),
])
def test_user_stops_and_user_errors_are_never_restarted(result, why):
    script = Script(result)
    status, out = run(RestartPolicy(max_restarts=5), ["a"], script)
    assert status == result.status and len(script.calls) == 1
    assert "not restarting: " in out and why in out


def test_ctrl_c_between_attempts_is_not_restarted():
    script = Script(FAIL, KeyboardInterrupt())
    status, out = run(RestartPolicy(max_restarts=3), ["a"], script)
    assert status == 130 and len(script.calls) == 2
    assert "interrupted between attempts" in out


def test_restart_drops_hosts_that_fail_the_precheck_and_they_rejoin_later():
    script = Script(FAIL, down(b="connection refused at 127.0.0.2:22"), FAIL, AttemptResult(0))
    status, out = run(RestartPolicy(max_restarts=2), ["a", "b"], script)
    assert status == 0
    assert [(c[0], c[1]) for c in script.calls] == [(0, ["a", "b"]), (1, ["a", "b"]), (1, ["a"]), (2, ["a", "b"])]
    assert "dsrun: dropping host b: connection refused at 127.0.0.2:22" in out
    assert script.calls[2][2].endswith("on 1 host(s): a")  # the restart line names the hosts it runs on


def test_max_nodes_takes_the_first_healthy_hosts_and_a_spare_replaces_a_lost_one():
    script = Script(FAIL, down(a="no answer"), AttemptResult(0))
    status, _ = run(RestartPolicy(max_restarts=1, max_nodes=2), ["a", "b", "c"], script)
    assert status == 0
    assert [c[1] for c in script.calls] == [["a", "b"], ["a", "b"], ["b", "c"]]


def test_too_few_hosts_on_restart_ends_the_job_with_the_last_failure():
    script = Script(FAIL, down(b="refused", c="refused"))
    status, out = run(RestartPolicy(max_restarts=3, min_nodes=2), ["a", "b", "c"], script)
    assert status == FAIL.status and len(script.calls) == 2
    assert "cannot restart: only 1 host(s) passed the pre-check (a), fewer than the 2 required" in out


def test_first_attempt_keeps_todays_all_hosts_rule_unless_min_nodes_is_given():
    with pytest.raises(RuntimeError, match=r"pre-check failed on \['b'\]"):
        run(RestartPolicy(max_restarts=1), ["a", "b"], Script(down(b="refused")))
    script = Script(down(b="refused"), AttemptResult(0))
    status, out = run(RestartPolicy(min_nodes=1), ["a", "b"], script)
    assert status == 0 and [c[1] for c in script.calls] == [["a", "b"], ["a"]]
    assert "dropping host b: refused" in out
    with pytest.raises(NotEnoughHosts, match="fewer than the 2 required.*nothing was started"):
        run(RestartPolicy(min_nodes=2), ["a", "b"], Script(down(b="refused")))


@pytest.mark.parametrize("policy,hosts,match", [
    (RestartPolicy(min_nodes=3, max_nodes=2), 4, "--min_nodes 3 is more than --max_nodes 2"),
    (RestartPolicy(min_nodes=3), 2, "--min_nodes 3 but only 2 host"),
])
def test_impossible_policies_are_refused_before_anything_starts(policy, hosts, match):
    script = Script()
    with pytest.raises(ValueError, match=match):
        run(policy, [f"h{i}" for i in range(hosts)], script)
    assert script.calls == []


def test_restarts_refused_for_mpirun_launchers(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=1\n")
    (tmp_path / "s.py").write_text("")
    result = CliRunner().invoke(cli, ["--hostfile", str(tmp_path / "hosts"), "--launcher", "openmpi",
                                      "--max_restarts", "1", str(tmp_path / "s.py")])
    assert result.exit_code == 2 and "--launcher openmpi hands the ranks to mpirun" in result.output

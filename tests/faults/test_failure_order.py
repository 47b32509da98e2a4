"""The failure report names the root cause whatever order the ranks' deaths reach the launcher.

See [Note: root cause order] in dsrun/launcher/failure.py and [Note: which
exits are failures] in dsrun/launcher/agent.py. The launch forces the bad
order: a peer's "exited while rank 0 waited" error is seen, and has
started the teardown, before the SIGKILL of the rank it is about.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from dsrun.launcher.failure import RankFailure, by_root_cause
from tests.launcher.conftest import launcher  # noqa: F401 (fixture)

SCRIPT = Path(__file__).parent / "scripts" / "peer_error_first.py"


def _failure(rank: int, time: float, code: int, sig: str | None = None, stderr: str = "",
             reason: str | None = None) -> RankFailure:
    return RankFailure(host="node-a", node_rank=0, rank=rank, local_rank=rank, pid=100 + rank, exit_code=code,
                       signal=sig, stderr_tail=[stderr] if stderr else [], time=time, reason=reason)


def test_root_cause_order_is_by_cause_then_time():
    lost = _failure(0, 1.0, 1, stderr="RuntimeError: shm collective: rank 1 (pid 101) exited while rank 0 waited")
    gloo = _failure(2, 1.5, 1, stderr="RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    abort = _failure(3, 1.2, 134, "SIGABRT", stderr="terminate called: Connection reset by peer")
    killed = _failure(1, 2.0, 137, "SIGKILL")
    raised = _failure(4, 1.1, 1, stderr="ValueError: boom")
    hung = _failure(5, 3.0, 124, reason="hung")
    assert [f.rank for f in by_root_cause([lost, gloo, abort, killed, raised])] == [1, 4, 0, 3, 2]
    assert [f.rank for f in by_root_cause([lost, hung, raised])] == [5, 4, 0]
    assert [f.rank for f in by_root_cause([raised, _failure(6, 0.5, 3)])] == [6, 4]  # same class: earliest


@pytest.mark.slow
def test_a_peer_error_seen_before_the_sigkill_still_names_the_killed_rank(launcher):  # noqa: F811
    result = launcher.run("--num_procs", "3", str(SCRIPT), timeout=120)
    err = result.stderr
    assert result.returncode == 137, err
    # First line of each row of the table: rank, node, pid, exit, cause.
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in err.splitlines() if line.startswith("│ ")]
    rows = [row for row in rows if row[0].isdigit()]
    # rank 1's SIGKILL heads the table although rank 0's error came first; rank 2 was
    # stopped by the teardown (SIGTERM): not a failure, no row
    assert [(row[0], row[3]) for row in rows] == [("1", "137"), ("0", "1")], err
    assert rows[0][4].startswith("root cause: SIGKILL"), err
    assert "Root cause: rank 1 on localhost (SIGKILL" in err, err

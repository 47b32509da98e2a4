"""A hung rank restarted: `dsrun --hang_timeout` reports it, `--max_restarts` starts the job again, and
`checkpoint.auto_resume` carries it on (issue 28 items 1, 2 and 4 together; 2 local ranks, gloo).

On the first attempt rank 1 blocks for ever in step 4, in a receive no rank
sends, while rank 0 waits in the step's collectives (tests/faults/scripts/
restart_train.py --hang). Nothing crashes: only the heartbeats stop. The
launcher must report the hang within the timeout, end the attempt, restart
it, and the restart must resume from step 3's checkpoint and end bit for bit
where an uninterrupted run ends (same world size: the loader's position and
the RNG states come back).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsrun.launcher.hang import HANG_EXIT_CODE
from tests.dist_helpers import free_port
from tests.faults.test_restarts import SCRIPT, STEPS, launcher, records  # noqa: F401 (launcher: a fixture)
from tests.launcher.conftest import Launcher

pytestmark = pytest.mark.slow

# Seconds; margin for a loaded 2-core machine between steps after initialize (inside it no rank is watched).
HANG_TIMEOUT_S = 8



def _train(launcher: Launcher, tmp_path: Path, name: str, *args: str) -> tuple[str, list[dict], list]:
    out = tmp_path / f"{name}.jsonl"
    result = launcher.run("--num_procs", "2", "--master_port", str(free_port()), "--no_local_rank",
                          "--grace_period", "2", "--hang_timeout", str(HANG_TIMEOUT_S), *args[:2], str(SCRIPT),
                          str(tmp_path / f"{name}-ckpt"), str(out), str(STEPS), "loader", *args[2:], timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return (log, *records(out))


def test_a_rank_hung_in_communication_is_reported_restarted_and_resumed(launcher, tmp_path):
    _, steps0, final0 = _train(launcher, tmp_path, "whole", "--max_restarts", "0")
    log, steps, final = _train(launcher, tmp_path, "hung", "--max_restarts", "1", "--hang", "1:4")
    flat = " ".join(log.split())  # rich wraps the summary at the console width
    assert "[rank 1] blocking in step 4" in log
    assert f"made no progress for {HANG_TIMEOUT_S} s" in flat, log[-4000:]
    # rank 0 waits inside the step's ZeRO collective, rank 1 is named as the cause, its stack in the receive
    assert re.search(r"rank 0 on localhost \(pid \d+\): last heartbeat [\d.]+ s ago; step 3; inside ", flat), flat
    assert "Likely cause: rank(s) 1:" in flat
    rank1 = log.split("Stacks of rank 1", 1)[1].split("dsrun: restart", 1)[0]
    assert "in recv" in rank1 and "restart_train.py" in rank1, rank1
    assert (f"dsrun: restart 1/1 after rank 1 on localhost ended with exit code {HANG_EXIT_CODE}: "
            "on 1 host(s): localhost") in flat, flat[-4000:]
    assert "auto_resume: resumed from step 3" in log and "on 2 rank(s)" in log
    assert "succeeded after 1 restart(s)" in log
    assert [(r["step"], r["restart"]) for r in steps] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1)]
    assert [r["loss"] for r in steps] == [r["loss"] for r in steps0]  # bitwise: floats compared exactly
    assert final == final0

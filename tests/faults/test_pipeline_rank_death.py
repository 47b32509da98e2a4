"""A pipeline rank dying inside a `train_batch` schedule ends the whole job.

Rank 1 leaves mid-schedule in step 2 (os._exit(1), or SIGKILL as the OOM
killer would) while its pipeline neighbour waits on it in a gloo receive and
its data-parallel peers run on to the next collective. The launcher must end
the job with a non-zero status as fast as when a plain rank fails (the
bound of tests/launcher/test_launch.py's fail-fast test), and leave no rank
process behind.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.launcher.conftest import Launcher, assert_no_leftovers

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_rank_dies.py"
FAIL_FAST_S = 5.0  # tests/launcher/test_launch.py: a failing rank ends the job within this


@pytest.fixture
def launcher(tmp_path: Path):
    launcher = Launcher(tmp_path)
    launcher.env["OMP_NUM_THREADS"] = "1"
    yield launcher
    assert_no_leftovers(launcher.marker)


@pytest.mark.parametrize("num_procs,mode,code", [(2, "exit", 1), (4, "sigkill", 137)])
def test_rank_dying_mid_schedule_ends_the_job(launcher, tmp_path, num_procs, mode, code):
    """2 ranks: pipe=2; 4 ranks: pipe=2 x data=2 (rank 1 is stage 0 of replica 1)."""
    death = tmp_path / "death"
    result = launcher.run("--num_procs", str(num_procs), str(SCRIPT), mode, str(death), timeout=120)
    ended = time.time()
    out = result.stdout + result.stderr
    assert death.exists(), f"rank 1 did not reach step 2's schedule:\n{out}"
    assert result.returncode != 0, out
    assert "step 1 done" in result.stdout and "step 2 done" not in result.stdout, out
    assert ended - float(death.read_text()) < FAIL_FAST_S, out
    # rank 1's own exit is in the failure table, and the summary names it as the root cause, whichever
    # exit reached the launcher first (its neighbours only lost their connection to it; see
    # [Note: root cause order] in dsrun/launcher/failure.py)
    rows = [line for line in result.stderr.splitlines() if line.startswith("│ 1 ")]
    assert rows and f"│ {code} " in rows[0], result.stderr
    assert "Root cause: rank 1 " in result.stderr, result.stderr

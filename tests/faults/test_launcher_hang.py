"""Hung ranks under the real launcher (issue 28 item 4): `dsrun --hang_timeout` ([Note: hung ranks] in hang.py).

Each launch runs tests/faults/scripts/hang_steps.py: two gloo ranks doing
one all_reduce per step through dsrun.comm. A rank that stops must be
reported within the timeout (plus the agent's reading period and the dump)
with both ranks' stacks and last collectives, and the job must end with
nothing left; a slow rank that still steps, and a rank still starting up,
must not be touched.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from rich.console import Console

from dsrun.launcher.hang import HANG_EXIT_CODE
from dsrun.launcher.head import Head
from dsrun.launcher.job import local_node_job
from dsrun.launcher.local import LocalRunner
from dsrun.launcher.placement import build_placement, node_jobs
from tests.dist_helpers import free_port
from tests.launcher.conftest import ROOT, Launcher, assert_no_leftovers

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "hang_steps.py"
TIMEOUT_S = 3.0
# Detection is within the timeout plus two reading periods (0.3 s each at 3 s); the rest is a loaded machine.
MARGIN_S = 1.5


@pytest.fixture
def launcher(tmp_path: Path):
    launcher = Launcher(tmp_path)
    yield launcher
    assert_no_leftovers(launcher.marker)


def _launch(launcher: Launcher, hang_timeout: float, *script_args: str):
    return launcher.run("--num_procs", "2", "--master_port", str(free_port()), "--no_local_rank",
                        "--grace_period", "2", "--hang_timeout", f"{hang_timeout:g}", str(SCRIPT), *script_args,
                        timeout=120)


def _job_id(stderr: str) -> str:
    return re.search(r"dsrun: job (dsrun-\S+):", stderr).group(1)


def _flat(stderr: str) -> str:
    """The summary without the line breaks rich adds at the console width."""
    return " ".join(stderr.split())


def test_a_rank_blocked_before_a_collective_fails_the_job_with_every_ranks_stack(launcher):
    result = _launch(launcher, TIMEOUT_S, "block", "0", "6")
    err = _flat(result.stderr)
    assert result.returncode == HANG_EXIT_CODE, result.stderr
    assert "[rank 1] blocking" in result.stdout and "done" not in result.stdout
    # rank 1 is named first, as the likely cause, with reason "hung"
    assert re.search(r"│ 1 │ localhost \(node 0\) │ \d+ │ 124 │ root cause: hung", err), result.stderr
    assert "Likely cause: rank(s) 1:" in err
    # rank 0 waits inside the third all_reduce; rank 1 finished the second
    assert re.search(r"rank 0 on localhost \(pid \d+\): last heartbeat [\d.]+ s ago; inside all_reduce #3 over "
                     r"2 rank\(s\), 16 B", err), err
    assert re.search(r"rank 1 on localhost \(pid \d+\): last heartbeat [\d.]+ s ago; last collective all_reduce "
                     r"#2 over 2 rank\(s\), 16 B, entered [\d:.]+, finished", err), err
    # reported within the timeout and a margin of rank 1's last beat
    silence = float(re.search(r"rank 1 on localhost \(pid \d+\): last heartbeat ([\d.]+) s ago", err).group(1))
    assert TIMEOUT_S <= silence <= TIMEOUT_S + MARGIN_S, silence
    # both ranks' Python stacks: rank 0 in dsrun's all_reduce, rank 1 in its wait
    stacks = result.stderr.split("Stacks of rank 0", 1)[1]
    rank0, rank1 = stacks.split("Stacks of rank 1", 1)
    assert "in all_reduce" in rank0 and "hang_steps.py" in rank0
    assert "threading.py" in rank1 and "in wait" in rank1 and "hang_steps.py" in rank1
    # the agent's heartbeat directory is gone
    assert not list(Path(tempfile.gettempdir()).glob(f"{_job_id(result.stderr)}-node*"))


def test_a_slow_rank_that_still_steps_is_not_killed(launcher):
    """Every step takes 0.45x the timeout (rank 0 waits that long inside each all_reduce), 4 steps in all:
    the job outlives the timeout and its reading periods (1.8 timeouts) while every beat comes within it."""
    result = _launch(launcher, TIMEOUT_S, "slow", f"{0.45 * TIMEOUT_S:g}", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done") == 2


def test_a_rank_starting_up_for_longer_than_the_timeout_is_not_killed(launcher):
    """Rank 1 sleeps 2.5 timeouts before its first collective; rank 0 waits inside it all that time."""
    result = _launch(launcher, 2.0, "startup", "5", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done") == 2


def test_the_head_collects_the_stacks_of_nodes_whose_ranks_are_not_hung(tmp_path):
    """Two agents (one rank each, both here): node 1's agent finds rank 1 hung; node 0's, with a long
    timeout, reports rank 0's stack because the head asks it to."""
    launcher = Launcher(tmp_path)  # for its marked environment
    placement = build_placement({"localhost": [0], "127.0.0.1": [0]})
    jobs = node_jobs(placement, job_id=f"dsrun-hangtest-{free_port()}", master_addr="127.0.0.1",
                     master_port=free_port(), command=[sys.executable, "-u", str(SCRIPT), "block", "0", "6"],
                     cwd=str(tmp_path), env={"PYTHONPATH": str(ROOT), "DSRUN_TEST_MARKER": launcher.marker},
                     grace_period=2.0, pass_local_rank=False, log_dir=None, visible_devices=False,
                     rendezvous_timeout=60.0, hang_timeout=TIMEOUT_S)
    jobs[0] = dataclasses.replace(jobs[0], hang_timeout=120.0)
    err = tmp_path / "err"
    with open(err, "w+b") as sink, open(tmp_path / "out", "w+b") as out:
        console = Console(file=open(tmp_path / "summary", "w"), width=200)
        status = Head(jobs, LocalRunner(), console, stdout=out, stderr=sink).run()
        console.file.close()
    summary = (tmp_path / "summary").read_text()
    assert status == HANG_EXIT_CODE, summary + err.read_text()
    assert "Hang: rank(s) 1 made no progress" in summary
    assert re.search(r"rank 0 on localhost \(pid \d+\): last heartbeat [\d.]+ s ago; inside all_reduce #3", summary)
    assert "Stacks of rank 0 on localhost" in summary and "Stacks of rank 1 on 127.0.0.1" in summary
    rank0 = summary.split("Stacks of rank 0", 1)[1].split("Stacks of rank 1", 1)[0]
    assert "in all_reduce" in rank0
    assert_no_leftovers(launcher.marker)


def test_the_heartbeat_directory_goes_when_the_agent_is_killed(tmp_path):
    """The agent's watchdog removes the directory when the agent cannot (SIGKILL)."""
    launcher = Launcher(tmp_path)
    script = tmp_path / "show.py"
    script.write_text("import os, time\nprint(os.environ['DSRUN_HEARTBEAT_FILE'], flush=True)\ntime.sleep(60)\n")
    job = local_node_job([sys.executable, "-u", str(script)], 1, "127.0.0.1", free_port(), grace_period=1.0,
                         pass_local_rank=False, log_dir=None)
    agent = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.agent"], cwd=tmp_path, env=launcher.env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        agent.stdin.write(job.to_json_line())
        agent.stdin.flush()
        directory = Path(agent.stdout.readline().removeprefix("[rank 0] ").strip()).parent
        assert directory.is_dir() and directory.name.startswith(f"{job.job_id}-node0-heartbeat-")
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=5)
        deadline = time.monotonic() + 5
        while directory.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not directory.exists()
    finally:
        if agent.poll() is None:
            agent.kill()
    assert_no_leftovers(launcher.marker)


@pytest.mark.parametrize("hang_timeout", [0, 600])
def test_a_rank_gets_its_agents_heartbeat_file_and_never_an_inherited_one(launcher, tmp_path, hang_timeout):
    """A dsrun started from inside a rank (a nested launch) must not hand its own rank's file down."""
    (tmp_path / "show.py").write_text("import os\nprint('FILE', os.environ.get('DSRUN_HEARTBEAT_FILE'))\n")
    launcher.env["DSRUN_HEARTBEAT_FILE"] = str(tmp_path / "outer_rank_file")
    result = launcher.run("--num_procs", "1", "--master_port", str(free_port()), "--no_local_rank",
                          "--hang_timeout", str(hang_timeout), "show.py", timeout=60)
    assert result.returncode == 0, result.stderr
    seen = result.stdout.split("FILE ", 1)[1].split()[0]
    if hang_timeout == 0:
        assert seen == "None"
    else:
        assert re.fullmatch(rf"{re.escape(tempfile.gettempdir())}/dsrun-\S+-node0-heartbeat-\w+/rank_0", seen), seen

"""End-to-end tests of the local launcher: real `dsrun` processes, real ranks, real signals."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from dsrun.launcher.job import local_node_job
from dsrun.launcher.placement import derived_port

from conftest import SCRIPTS

pytestmark = pytest.mark.slow


def _rank_records(stdout: str) -> dict[int, dict]:
    records = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("ENV "):
            record = json.loads(rest[4:])
            records[int(prefix.removeprefix("[rank "))] = record
    return records


def test_env_contract_and_untouched_args(launcher, tmp_path):
    args = ["--foo", "bar", "-x", "--num_procs", "7", "--", "tail"]
    result = launcher.run("--num_procs", "2", "--log_dir", "logs", "--no_local_rank", str(SCRIPTS / "print_env.py"),
                          *args)
    assert result.returncode == 0, result.stderr
    records = _rank_records(result.stdout)
    assert sorted(records) == [0, 1]
    job_ids = {r["env"]["DSRUN_JOB_ID"] for r in records.values()}
    assert len(job_ids) == 1 and job_ids.pop().startswith("dsrun-")
    port = records[0]["env"]["MASTER_PORT"]
    for rank, record in records.items():
        assert record["argv"] == args  # dsrun's own option names after the script are the script's
        assert record["env"] == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "LOCAL_SIZE": "2", "NODE_RANK": "0", "GROUP_RANK": "0", "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DSRUN_JOB_ID": record["env"]["DSRUN_JOB_ID"],
            "PYTHONUNBUFFERED": "1",
        }
        # stderr lines are relayed with the prefix; the log has both streams, unprefixed.
        assert f"[rank {rank}] to stderr from rank {rank}" in result.stderr
        log = (tmp_path / "logs" / f"rank_{rank}.log").read_text().splitlines()
        assert sorted(log) == sorted([f"ENV {json.dumps(record)}", f"to stderr from rank {rank}"])


def test_local_rank_is_appended_by_default(launcher):
    result = launcher.run("--num_gpus", "2", str(SCRIPTS / "print_env.py"), "a")
    assert result.returncode == 0, result.stderr
    records = _rank_records(result.stdout)
    assert {rank: r["argv"] for rank, r in records.items()} == {0: ["a", "--local_rank=0"], 1: ["a", "--local_rank=1"]}


def test_module_mode_runs_python_dash_m(launcher, tmp_path):
    (tmp_path / "rankmod.py").write_text("import os, sys; print('module', os.environ['RANK'], sys.argv[1:])\n")
    result = launcher.run("--num_procs", "1", "--module", "rankmod", "--x")
    assert result.returncode == 0, result.stderr
    assert "[rank 0] module 0 ['--x', '--local_rank=0']" in result.stdout


def test_a_raising_rank_ends_the_job_fast_and_its_traceback_is_shown(launcher):
    start = time.monotonic()
    result = launcher.run("--num_procs", "2", str(SCRIPTS / "raise_or_sleep.py"))
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    # Rank 0 sleeps 60 s: a job that ends well before that was torn down when
    # rank 1 failed, rather than waiting for the sleeper (no tighter bound: a
    # loaded machine takes seconds just to start the ranks).
    assert elapsed < 40.0, f"the job took {elapsed:.1f} s to end although rank 1 failed"
    summary = result.stderr[result.stderr.index("Root cause: rank 1"):]
    # The whole chained traceback, not just the last 40 lines: both headers, the
    # outermost frame, and the final exception.
    assert summary.count("Traceback (most recent call last):") == 2
    assert "The above exception was the direct cause of the following exception:" in summary
    assert "KeyError: 'missing'" in summary
    assert 'raise_or_sleep.py", line 17, in <module>' in summary
    assert summary.rstrip().endswith("ValueError: boom from rank 1")
    assert "Python exception" in result.stderr


def test_a_rank_killed_by_sigkill_is_reported_by_signal_name(launcher):
    result = launcher.run("--num_procs", "2", str(SCRIPTS / "sigkill_self.py"))
    assert result.returncode == 137, result.stderr
    assert "SIGKILL: likely out of memory" in result.stderr
    assert "Root cause: rank 1" in result.stderr


def _wait_for_lines(stream, count: int, timeout: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while len(lines) < count:
        assert time.monotonic() < deadline, f"ranks did not start in time; got {lines}"
        line = stream.readline()
        if line:
            lines.append(line)
    return lines


def test_sigint_ends_ranks_that_ignore_sigterm_after_the_grace_period(launcher):
    proc = launcher.popen("--num_procs", "2", "--grace_period", "1", str(SCRIPTS / "ignore_term.py"))
    try:
        ready = _wait_for_lines(proc.stdout, 2, timeout=20)
        assert all("ready pid=" in line for line in ready)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=15)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, proc.stderr.read()
    assert 1.0 <= elapsed < 6.0, f"teardown took {elapsed:.1f} s with a 1 s grace period"
    assert "stopped by SIGINT" in proc.stderr.read()


def test_agent_killed_with_sigkill_takes_its_ranks_along(launcher, tmp_path):
    job = local_node_job([sys.executable, "-u", str(SCRIPTS / "ignore_term.py")], 2, "127.0.0.1", 29500,
                         grace_period=30, pass_local_rank=False, log_dir=None)
    agent = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.agent"], cwd=tmp_path, env=launcher.env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        agent.stdin.write(job.to_json_line())
        agent.stdin.flush()
        ready = _wait_for_lines(agent.stdout, 2, timeout=20)
        rank_pids = [int(line.split("pid=")[1].split()[0]) for line in ready]
        os.killpg(agent.pid, signal.SIGKILL)  # as the head's hard kill does: the agent's whole group
        agent.wait(timeout=5)
        deadline = time.monotonic() + 3
        while any(_alive(pid) for pid in rank_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in rank_pids), "ranks survived their agent"
    finally:
        if agent.poll() is None:
            agent.kill()
    # The ranks' children (which ignore SIGTERM) died too: the agent's watchdog killed their groups,
    # which the `launcher` fixture checks.


def test_stdin_eof_stops_the_ranks(launcher, tmp_path):
    job = local_node_job([sys.executable, "-u", str(SCRIPTS / "raise_or_sleep.py")], 1, "127.0.0.1", 29500,
                         grace_period=1, pass_local_rank=False, log_dir=None)
    agent = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.agent"], cwd=tmp_path, env=launcher.env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    agent.stdin.write(job.to_json_line())
    agent.stdin.flush()
    _wait_for_lines(agent.stdout, 1, timeout=20)
    agent.stdin.close()  # the head went away
    assert agent.wait(timeout=10) == 129


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_default_port_is_derived_from_the_job_id(launcher):
    """Without --master_port the rendezvous port is one derived from the job id, not 29500 (see ports.py)."""
    result = launcher.run("--num_procs", "1", str(SCRIPTS / "print_env.py"))
    assert result.returncode == 0, result.stderr
    env = _rank_records(result.stdout)[0]["env"]
    assert int(env["MASTER_PORT"]) in [derived_port(env["DSRUN_JOB_ID"], i) for i in range(8)]
    assert "in use" not in result.stderr


def test_busy_explicit_port_is_an_error(launcher):
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        result = launcher.run("--num_procs", "1", "--master_port", str(busy), str(SCRIPTS / "print_env.py"))
    assert result.returncode == 2
    assert f"--master_port {busy} is already in use" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "Missing argument 'SCRIPT'"),
        (["no_such_script.py"], "file 'no_such_script.py' does not exist"),
        (["--num_procs", "0", "x.py"], "0 is not a number of processes; give 1 or more"),
        (["--num_procs", "-2", "x.py"], "-2 is not a number of processes; give 1 or more"),
        (["--num_procs", "two", "x.py"], "'two' is not a valid integer"),
    ],
)
def test_cli_errors_are_clear(launcher, args, message):
    result = launcher.run(*args)
    assert result.returncode == 2
    assert message in " ".join(result.stderr.split()), result.stderr


def test_ranks_rendezvous_with_gloo_from_the_environment(launcher):
    result = launcher.run("--num_procs", "2", str(SCRIPTS / "gloo_allreduce.py"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if "sum=" in line) == [
        "[rank 0] sum=3 world=2", "[rank 1] sum=3 world=2"]


def test_default_process_count_without_gpus_is_one_and_said(launcher):
    result = launcher.run(str(SCRIPTS / "print_env.py"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert list(_rank_records(result.stdout)) == [0]
    assert "no CUDA GPU visible; starting 1 process (pass --num_procs N to start N)" in result.stderr

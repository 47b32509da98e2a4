"""Local launches under faults (issue 11, items 8, 9, 11 and 12): real `dsrun` processes and ranks.

Each test reproduces one probe of the issue: a flag that changed what a
local launch gives its ranks, a daemon that outlived its job, a rendezvous
that could never open, a traceback hidden behind torch's `[rank1]:` prefix.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from tests.launcher.conftest import Launcher, assert_no_leftovers

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
LAUNCHER_SCRIPTS = Path(__file__).parents[1] / "launcher" / "scripts"


@pytest.fixture
def launcher(tmp_path: Path):
    launcher = Launcher(tmp_path)
    yield launcher
    assert_no_leftovers(launcher.marker)


def _env_of_ranks(stdout: str) -> dict[int, dict[str, str]]:
    out = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("SEEN "):
            out[int(prefix.removeprefix("[rank "))] = json.loads(rest[5:])
    return out


@pytest.mark.parametrize("flags", [[], ["--env", "X=1"], ["--print_env"]])
def test_flags_do_not_change_a_local_launch(launcher, tmp_path, flags):
    """Item 8: CUDA_VISIBLE_DEVICES is inherited and .dsrun_env applied, whatever the flags."""
    (tmp_path / "seen.py").write_text(
        "import json, os\n"
        "print('SEEN ' + json.dumps({k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'FROM_FILE')}))\n")
    (tmp_path / ".dsrun_env").write_text("FROM_FILE=yes\n")
    launcher.env["CUDA_VISIBLE_DEVICES"] = "2,3"
    result = launcher.run("--num_procs", "2", *flags, "seen.py", timeout=60)
    assert result.returncode == 0, result.stderr
    seen = _env_of_ranks(result.stdout)
    assert seen == {r: {"CUDA_VISIBLE_DEVICES": "2,3", "FROM_FILE": "yes"} for r in (0, 1)}
    if "--print_env" in flags:  # what it shows is what the ranks got
        shown = " ".join(result.stderr.split())
        assert "rank 1: CUDA_VISIBLE_DEVICES=2,3 RANK=1" in shown and "FROM_FILE=<3 chars>" in shown, shown


def test_dry_run_print_env_shows_the_inherited_devices(launcher):
    launcher.env["CUDA_VISIBLE_DEVICES"] = "2,3"
    result = launcher.run("--num_procs", "2", "--dry_run", "--print_env", str(LAUNCHER_SCRIPTS / "print_env.py"))
    assert result.returncode == 0, result.stderr
    assert "rank 0: CUDA_VISIBLE_DEVICES=2,3 RANK=0" in " ".join(result.stderr.split())


@pytest.mark.parametrize("code", [0, 3])
def test_daemons_of_ranks_die_with_the_job_and_do_not_delay_it(launcher, tmp_path, code):
    """Item 9: a rank's daemon (double fork + setsid) holding its stdout is killed at teardown, quickly."""
    pidfile = tmp_path / "daemon"
    start = time.monotonic()
    result = launcher.run("--num_procs", "2", "--grace_period", "2", "--no_local_rank",
                          str(SCRIPTS / "spawn_daemon.py"), str(code),
                          str(pidfile), timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == code, result.stderr
    # A failing rank's peer may be stopped before its daemon started; every daemon that did start must be gone.
    daemons = [int(f.read_text()) for f in tmp_path.glob("daemon.rank*")]
    assert len(daemons) == 2 or (code and daemons)
    alive = [p for p in daemons if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"daemons outlived the job: {alive}"
    if code:
        assert f"rank 0 fails with {code}" in result.stderr or f"rank 1 fails with {code}" in result.stderr
    # Before: 2 s per pump waiting for EOF on pipes the daemons held, at several points of the teardown.
    assert elapsed < 8, f"dsrun took {elapsed:.1f} s"


def test_daemons_die_even_when_the_agent_is_sigkilled(launcher, tmp_path):
    """Item 9: the agent hands adopted daemons' groups to its watchdog, which outlives a SIGKILL of the agent."""
    pidfile = tmp_path / "daemon"
    proc = launcher.popen("--num_procs", "1", str(SCRIPTS / "spawn_daemon.py"), "0", str(pidfile), "60")
    try:
        deadline = time.monotonic() + 30
        while not pidfile.with_name("daemon.rank0").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        daemon = psutil.Process(int(pidfile.with_name("daemon.rank0").read_text()))
        time.sleep(2.5)  # the agent tells its watchdog about adopted processes once a second
        agent = psutil.Process(daemon.ppid())  # adopted by the agent (a child subreaper), not by init
        assert "dsrun.launcher.agent" in " ".join(agent.cmdline())
        agent.kill()
        daemon.wait(timeout=10)  # raises psutil.TimeoutExpired if the daemon survived
    finally:
        proc.communicate(timeout=30)


def test_master_addr_of_another_machine_on_one_node_is_an_error(launcher):
    """Item 11: ranks would wait 30 minutes for a rendezvous that cannot open here."""
    result = launcher.run("--num_procs", "2", "--master_addr", "192.0.2.1", str(LAUNCHER_SCRIPTS / "print_env.py"),
                          timeout=30)
    assert result.returncode == 2
    assert "--master_addr 192.0.2.1 is not an address of this machine" in " ".join(result.stderr.split())


def test_ranks_that_never_arrive_are_named_after_the_rendezvous_timeout(launcher, tmp_path):
    """Item 11: rank 1 never calls init_distributed; rank 0 fails after --rendezvous_timeout naming it."""
    (tmp_path / "late.py").write_text(
        "import os, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(60)\n"
        "import dsrun\n"
        "dsrun.init_distributed()\n")
    start = time.monotonic()
    result = launcher.run("--num_procs", "2", "--rendezvous_timeout", "3", "--grace_period", "1", "late.py",
                          timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    err = " ".join(result.stderr.split())
    assert "rank 1 never arrived" in err and "--rendezvous_timeout" in err, result.stderr
    assert elapsed < 45


def test_traceback_behind_torch_rank_prefix_is_the_root_cause(launcher, tmp_path):
    """Item 12: torch writes `[rank1]: ` before each line; the summary still shows the traceback."""
    (tmp_path / "prefixed.py").write_text(
        "import sys, traceback\n"
        "try:\n"
        "    raise ValueError('bad batch shape')\n"
        "except ValueError:\n"
        "    for line in traceback.format_exc().splitlines():\n"
        "        print('[rank1]: ' + line, file=sys.stderr)\n"
        "    sys.exit(1)\n")
    result = launcher.run("--num_procs", "1", "prefixed.py", timeout=60)
    assert result.returncode == 1
    summary = result.stderr.split("Root cause:", 1)[1]
    assert "Python exception (traceback below)" in summary and "exited with code 1" not in summary
    assert "[rank1]: ValueError: bad batch shape" in summary


def test_orphans_that_exit_during_the_job_are_reaped(launcher, tmp_path):
    """Item 9: as a subreaper the agent inherits orphans; those that exit must not stay zombies until the end.

    Each orphan writes its pid and exits; the rank then waits for the test. An orphan the agent does not
    reap stays a zombie (its pid still exists), so the test polls until every one is gone while the job
    still runs, instead of sleeping a fixed time."""
    (tmp_path / "orphans.py").write_text(
        "import os, time\n"
        "for _ in range(5):\n"
        "    if os.fork() == 0:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(0.2)  # its parent has exited: the agent adopts it\n"
        "            open(f'orphan.{os.getpid()}', 'w').close()\n"
        "            os._exit(0)\n"
        "        os._exit(0)\n"
        "    os.wait()\n"
        "print('AGENT', os.getppid(), flush=True)\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists('looked') and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n")
    proc = launcher.popen("--num_procs", "1", "orphans.py")
    try:
        line = ""
        while not line.startswith("[rank 0] AGENT"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
        agent = psutil.Process(int(line.split()[-1]))
        deadline = time.monotonic() + 30
        while len(orphans := [int(f.name.split(".")[1]) for f in tmp_path.glob("orphan.*")]) < 5:
            assert time.monotonic() < deadline, f"only {len(orphans)} of 5 orphans wrote their pid"
            time.sleep(0.05)
        while zombies := [c.pid for c in agent.children() if c.pid in orphans]:
            assert time.monotonic() < deadline, f"unreaped orphans of the agent: {zombies}"
            time.sleep(0.05)
        assert proc.poll() is None  # reaped while the job runs, not at its end
    finally:
        (tmp_path / "looked").touch()
        proc.communicate(timeout=30)
    assert proc.returncode == 0

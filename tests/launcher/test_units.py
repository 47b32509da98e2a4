"""Unit tests of the launcher's pure parts: job validation, rank environment, stderr capture, ports."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import warnings

import pytest

from dsrun import numpy_warning
from dsrun.launcher.env import rank_argv, rank_process_env
from dsrun.launcher.failure import TAIL_LINES, TRACEBACK_MAX_LINES, RankFailure, StderrTail, exit_status, signal_name
from dsrun.launcher.job import InvalidNodeJob, NodeJob
from dsrun.launcher.placement import derived_port
from dsrun.launcher.ports import PortError, choose_master_port, is_local_address
from dsrun.launcher.proctree import EXITED, children_map, descendants


def _job(**changes) -> NodeJob:
    fields = dict(job_id="j", node_rank=1, nnodes=2, world_size=4, ranks=[2, 3], local_ranks=[0, 1],
                  master_addr="10.0.0.1", master_port=1234, command=["python", "t.py"], cwd="/")
    return NodeJob(**{**fields, **changes})


def test_node_job_round_trips_through_one_json_line():
    job = _job(env={"A": "1"}, log_dir="/tmp/x")
    line = job.to_json_line()
    assert line.endswith("\n") and line.count("\n") == 1
    assert NodeJob.from_json_line(line) == job


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(local_ranks=[0]), "must have the same length"),
        (dict(ranks=[2, 4]), "outside the world of size 4"),
        (dict(ranks=[2, 2]), "duplicates"),
        (dict(node_rank=2), "node_rank 2 must be below nnodes 2"),
        (dict(master_port=0), "master_port"),
        (dict(master_port="1234"), r"NodeJob.master_port must be an integer >= 1 and <= 65535, got '1234'"),
        (dict(grace_period=float("inf")), "grace_period must be a finite number >= 0"),
        (dict(ranks=[]), "ranks must be a non-empty list of integers"),
        (dict(env={"A": 1}), "env must be an object of string values"),
    ],
)
def test_node_job_rejects_contradictions(changes, message):
    with pytest.raises(InvalidNodeJob, match=message):
        _job(**changes)


def test_node_job_line_from_another_version_is_rejected_by_name():
    line = _job().to_json_line().replace('"job_id"', '"new_field":1,"job_id"').replace(',"cwd":"/"', "")
    with pytest.raises(InvalidNodeJob, match=r"unknown fields \['new_field'\], missing fields \['cwd'\]"):
        NodeJob.from_json_line(line)
    with pytest.raises(InvalidNodeJob, match="not a JSON NodeJob"):
        NodeJob.from_json_line("{not json")


def test_the_node_agent_imports_no_heavy_package():
    """The agent starts once per node and job; see [Note: no pydantic in the agent] in dsrun/launcher/records.py
    and [Note: no psutil in the agent] in dsrun/launcher/proctree.py."""
    heavy = ["torch", "numpy", "pydantic", "rich", "paramiko", "yaml", "psutil"]
    code = f"import sys, dsrun.launcher.agent; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_process_tree_finds_a_child_named_with_spaces_and_parentheses_then_its_zombie():
    """proctree parses /proc/<pid>/stat after the name's last ")"; an exited, unreaped child is EXITED."""
    code = ("import ctypes, sys; ctypes.CDLL(None).prctl(15, b'a) (b c', 0, 0, 0); "  # 15: PR_SET_NAME
            "print('named', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"named\n"
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            assert b"(a) (b c)" in f.read()
        assert dict(children_map()[os.getpid()])[child.pid] not in EXITED
        assert child.pid in dict(descendants(os.getpid()))
        child.stdin.close()
        for _ in range(6000):  # until the child has exited; it stays a zombie until waited for
            if dict(descendants(os.getpid())).get(child.pid) in EXITED:
                break
            time.sleep(0.01)
        assert dict(descendants(os.getpid()))[child.pid] in EXITED
    finally:
        child.kill()
        child.wait()


def test_rank_environment_on_a_second_node_and_precedence():
    job = _job(env={"FROM_JOB": "yes", "RANK": "99"}, pass_local_rank=True)
    env = rank_process_env(job, 1, {"RANK": "7", "INHERITED": "x"})
    assert env["INHERITED"] == "x" and env["FROM_JOB"] == "yes"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("3", "1", "4", "2")
    assert (env["NODE_RANK"], env["GROUP_RANK"], env["CROSS_RANK"], env["CROSS_SIZE"]) == ("1", "1", "1", "2")
    assert rank_argv(job, 1) == ["python", "t.py", "--local_rank=1"]


def test_ranks_without_numpy_get_a_filter_for_torchs_numpy_warning_only(monkeypatch):
    assert "PYTHONWARNINGS" not in rank_process_env(_job(), 0, {})  # NumPy is installed here: nothing added
    monkeypatch.setattr(numpy_warning, "numpy_missing", lambda: True)
    assert rank_process_env(_job(), 0, {})["PYTHONWARNINGS"] == "ignore:Failed to initialize NumPy:UserWarning"
    env = rank_process_env(_job(env={"PYTHONWARNINGS": "error::DeprecationWarning"}), 0, {})
    assert env["PYTHONWARNINGS"] == "ignore:Failed to initialize NumPy:UserWarning,error::DeprecationWarning"
    # As Python parses it: torch's message is hidden, any other warning shows, the user's filter still holds.
    code = (f"import warnings; warnings.warn({numpy_warning.MESSAGE!r}); warnings.warn('another one'); "
            "warnings.warn('old', DeprecationWarning)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": env["PYTHONWARNINGS"]})
    assert "NumPy" not in proc.stderr and "UserWarning: another one" in proc.stderr, proc.stderr
    assert proc.returncode != 0 and "DeprecationWarning: old" in proc.stderr, proc.stderr


@pytest.mark.parametrize("missing", [True, False])
def test_quiet_missing_numpy_hides_that_message_only_without_numpy(monkeypatch, missing):
    monkeypatch.setattr(numpy_warning, "numpy_missing", lambda: missing)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with numpy_warning.quiet_missing_numpy():
            warnings.warn(numpy_warning.MESSAGE)
            warnings.warn("Failed to initialize NumPy: _ARRAY_API not found")  # a broken NumPy: the user's to fix
    shown = [str(w.message) for w in seen]
    assert shown == [numpy_warning.MESSAGE] * (not missing) + ["Failed to initialize NumPy: _ARRAY_API not found"]


def test_exit_status_never_reads_a_signal_as_success():
    assert exit_status(0) == 0 and exit_status(3) == 3
    assert exit_status(-9) == 137 and signal_name(-9) == "SIGKILL"
    assert signal_name(1) is None


def test_stderr_tail_keeps_a_chained_traceback_whole():
    tail = StderrTail()
    tail.add("noise before")
    first = ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "KeyError: 'k'"]
    chain = ["", "The above exception was the direct cause of the following exception:", ""]
    frames = [f'  File "a.py", line {i}, in f' for i in range(2 * TAIL_LINES)]
    second = ["Traceback (most recent call last):", *frames, "ValueError: v"]
    for line in first + chain + second:
        tail.add(line)
    assert tail.traceback() == "\n".join(first + chain + second)
    assert len(tail.lines()) == TAIL_LINES and tail.lines()[-1] == "ValueError: v"


def test_stderr_tail_a_new_unchained_traceback_replaces_the_old_one():
    tail = StderrTail()
    for line in ["Traceback (most recent call last):", "OSError: first", "retrying",
                 "Traceback (most recent call last):", "OSError: second"]:
        tail.add(line)
    assert tail.traceback() == "Traceback (most recent call last):\nOSError: second"
    assert StderrTail().traceback() is None


def test_stderr_tail_caps_a_runaway_traceback_keeping_both_ends():
    tail = StderrTail()
    tail.add("Traceback (most recent call last):")
    for i in range(TRACEBACK_MAX_LINES * 2):
        tail.add(f"line {i}")
    text = tail.traceback().splitlines()
    assert text[0] == "Traceback (most recent call last):" and text[-1] == f"line {TRACEBACK_MAX_LINES * 2 - 1}"
    assert any("lines omitted" in line for line in text) and len(text) == TRACEBACK_MAX_LINES + 1


def test_failure_record_line_round_trip():
    failure = RankFailure(host="h", node_rank=0, rank=3, local_rank=1, pid=5, exit_code=137, signal="SIGKILL",
                          stderr_tail=["a"], traceback=None, time=1.5)
    assert RankFailure.from_line(failure.to_line()) == failure
    assert RankFailure.from_line("[rank 0] ordinary output") is None


def _listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", port))
    sock.listen()
    return sock


def test_default_master_port_is_the_first_free_port_derived_from_the_job_id():
    """Jobs started together on one machine do not race for 29500: each tries its own derived ports."""
    job = f"test-{os.getpid()}-{time.monotonic_ns()}"
    first, second = derived_port(job, 0), derived_port(job, 1)
    assert choose_master_port("127.0.0.1", None, job) == (first, None)
    with _listen(first):
        assert choose_master_port("127.0.0.1", None, job) == (second, None)
        with _listen(second):
            port, notice = choose_master_port("127.0.0.1", None, job, candidates=2)
    assert port not in (first, second)
    assert notice == (f"the 2 ports derived from job {job} are in use; using MASTER_PORT={port} instead "
                      "(pass --master_port to choose)")


def test_choose_master_port():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        with pytest.raises(PortError, match=f"--master_port {busy} is already in use"):
            choose_master_port("127.0.0.1", busy, "job")
        # A remote master cannot be checked from here: the port is used as given.
        assert choose_master_port("203.0.113.7", busy, "job") == (busy, None)
    assert is_local_address("localhost") and not is_local_address("203.0.113.7")

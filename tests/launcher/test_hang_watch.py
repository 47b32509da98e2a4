"""dsrun/launcher/hang.py and the hang part of summary.py: the stall rule, stack dumps, the report."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from dsrun.env import HEARTBEAT_FILE
from dsrun.launcher.agent import control_line
from dsrun.launcher.failure import RankFailure
from dsrun.launcher.hang import (HANG_EXIT_CODE, HANG_REASON, CollectiveCall, HangReport, HangWatch, RankSnapshot,
                                 likely_causes)
from dsrun.launcher.job import local_node_job
from dsrun.launcher.summary import print_failure_summary
from dsrun.runtime.observability.heartbeat import HeartbeatWriter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def watch(tmp_path: Path):
    (tmp_path / "hb").mkdir()
    watch = HangWatch(tmp_path / "hb", [0, 1, 2], timeout=10.0)
    yield watch
    watch.close()


def _job(hang_timeout: float):
    return dataclasses.replace(local_node_job(["python"], 2, "127.0.0.1", 29500, grace_period=1.0,
                                              pass_local_rank=False, log_dir=None), hang_timeout=hang_timeout)


def test_no_watch_with_timeout_zero_and_a_private_directory_otherwise():
    assert HangWatch.create(_job(0)) is None
    watch = HangWatch.create(_job(5))
    try:
        assert sorted(p.name for p in watch.directory.iterdir()) == ["rank_0", "rank_0.stacks", "rank_1",
                                                                      "rank_1.stacks"]
        assert watch.rank_env(1) == {HEARTBEAT_FILE.name: str(watch.directory / "rank_1")}
        assert watch.period == 0.5  # timeout / 10
    finally:
        watch.close()
    assert not watch.directory.exists()


def test_a_watch_needs_a_positive_timeout(tmp_path):
    with pytest.raises(ValueError, match="> 0 seconds"):
        HangWatch(tmp_path, [0], timeout=0)


def test_a_rank_that_never_beat_is_never_hung(watch):
    assert watch.stalled([0, 1, 2], now=0.0) == []
    assert watch.stalled([0, 1, 2], now=1000.0) == []


def test_a_rank_is_hung_after_timeout_seconds_without_a_beat(watch):
    writers = {r: HeartbeatWriter(watch.path(r)) for r in (0, 1, 2)}
    for w in writers.values():
        w.beat()
    assert watch.stalled([0, 1, 2], now=0.0) == []
    writers[1].beat()
    assert watch.stalled([0, 1, 2], now=5.0) == []
    writers[1].beat()
    assert watch.stalled([0, 1, 2], now=9.0) == []
    # ranks 0 and 2 silent since 0.0, rank 1 since 9.0; rank 2 has exited (not running)
    assert watch.stalled([0, 1], now=10.0) == [0]
    assert watch.stalled([0, 1, 2], now=18.5) == [0, 2]
    assert watch.stalled([0, 1, 2], now=19.5) == [0, 2, 1]  # longest silent first


def test_a_rank_that_began_to_exit_is_not_watched(watch):
    writer = HeartbeatWriter(watch.path(0))
    writer.beat()
    writer.exiting()
    assert watch.stalled([0], now=0.0) == []
    assert watch.stalled([0], now=100.0) == []


def test_the_files_are_read_at_most_once_a_period(watch):
    writer = HeartbeatWriter(watch.path(0))
    writer.beat()
    assert watch.stalled([0], now=0.0) == []
    assert watch.stalled([0], now=10.5) == [0]
    assert watch.stalled([0], now=10.6) == []  # within the period: not read again
    assert watch.stalled([0], now=11.6) == [0]


def _rank_process(channel: Path, body: str) -> subprocess.Popen:
    """A process leading its own group (as a rank does) that started its heartbeat, then runs `body`."""
    code = textwrap.dedent("""
        import threading, time
        from dsrun.runtime.observability import heartbeat
        heartbeat.start()
    """) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": str(ROOT), HEARTBEAT_FILE.name: str(channel)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_snapshot_has_each_ranks_stacks_and_last_collective(watch):
    inside = _rank_process(watch.path(0), """
        seq = heartbeat.collective_entered("all_reduce", 2, 16)
        heartbeat.collective_finished(seq)
        heartbeat.collective_entered("all_reduce", 2, 16)
        def waiting_in_all_reduce():
            print("ready", flush=True)
            time.sleep(60)
        waiting_in_all_reduce()
    """)
    unregistered = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); import time; "
                                     "time.sleep(60)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert inside.stdout.readline().strip() == "ready" and unregistered.stdout.readline().strip() == "ready"
        assert watch.stalled([0, 1], now=0.0) == []
        snaps = {s.rank: s for s in watch.snapshot({0: inside.pid, 1: unregistered.pid}, now=4.0)}
        assert (snaps[0].pid, snaps[0].beats, snaps[0].silent_s) == (inside.pid, 2, 4.0)
        assert snaps[0].collective.op == "all_reduce" and snaps[0].collective.seq == 2
        assert snaps[0].collective.finished is None and snaps[0].collective.bytes == 16
        assert "waiting_in_all_reduce" in snaps[0].stacks
        # no handler registered: not signalled (the signal would have killed it), no stacks
        assert snaps[1].beats == 0 and snaps[1].stacks is None and snaps[1].silent_s is None
        time.sleep(0.2)
        assert unregistered.poll() is None and inside.poll() is None
    finally:
        for proc in (inside, unregistered):
            proc.kill()
            proc.wait()


def test_a_pid_outside_the_ranks_group_is_not_signalled(watch):
    """The pid comes from a file the rank writes: only a process of the rank's own group is signalled."""
    HeartbeatWriter(watch.path(0)).claim(os.getpid())  # this process: not in the "rank's" group below
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        snap = watch.snapshot({0: other.pid})[0]
        assert snap.stacks is None
    finally:
        other.kill()
        other.wait()


def _snap(rank: int, seq: int | None, finished: bool, beats: int = 5) -> RankSnapshot:
    call = None if seq is None else CollectiveCall(seq=seq, op="all_reduce", group_size=4, bytes=16,
                                                   entered=100.0, finished=101.0 if finished else None)
    return RankSnapshot(rank=rank, pid=1000 + rank, beats=beats, step=3, silent_s=12.0, collective=call,
                        stacks=f"stack of {rank}")


def test_likely_causes():
    # rank 2 is outside any collective while the others wait in one
    assert likely_causes([_snap(0, 5, False), _snap(1, 5, False), _snap(2, 4, True)]) == [2]
    # all inside, rank 3 in an earlier one
    assert likely_causes([_snap(0, 5, False), _snap(3, 4, False)]) == [3]
    # none inside (NCCL: the all_reduce returned once enqueued), rank 1 never entered the fifth
    assert likely_causes([_snap(0, 5, True), _snap(1, 4, True)]) == [1]
    # nothing stands out
    assert likely_causes([_snap(0, 5, False), _snap(1, 5, False)]) == []
    assert likely_causes([_snap(0, 5, True), _snap(1, 5, True)]) == []
    # a rank that never beat is not a cause
    assert likely_causes([_snap(0, 5, False), _snap(1, None, False, beats=0)]) == []


def test_records_travel_as_lines():
    report = HangReport(host="n1", node_rank=1, timeout=3.0, time=200.0, hung=[2], ranks=[_snap(2, 4, True)])
    assert HangReport.from_line(report.to_line()) == report
    assert HangReport.from_line("[rank 0] hello") is None
    failure = RankFailure(host="n1", node_rank=1, rank=2, local_rank=0, pid=7, exit_code=HANG_EXIT_CODE,
                          time=1.0, reason=HANG_REASON)
    assert RankFailure.from_line(failure.to_line()) == failure
    assert json.loads(control_line(dump=True)) == {"dump": True}


def test_summary_shows_every_ranks_state_stacks_and_the_likely_cause():
    console = Console(record=True, width=200)
    failure = RankFailure(host="n0", node_rank=0, rank=1, local_rank=1, pid=1001, exit_code=HANG_EXIT_CODE,
                          time=1.0, reason=HANG_REASON, stderr_tail=["Traceback (most recent call last):"])
    reports = [HangReport(host="n0", node_rank=0, timeout=3.0, time=103.5, hung=[1],
                          ranks=[_snap(0, 5, False), _snap(1, 4, True)]),
               HangReport(host="n1", node_rank=1, timeout=3.0, time=103.5, hung=[],
                          ranks=[dataclasses.replace(_snap(2, 5, False, beats=0), stacks=None)])]
    print_failure_summary(console, "job", [failure], [], reports)
    text = console.export_text()
    assert "root cause: hung" in text and "Root cause: rank" not in text  # no traceback to show for a hang
    assert "rank 0 on n0 (pid 1000): last heartbeat 12.0 s ago; step 3; inside all_reduce #5 over 4 rank(s), 16 B" in text
    assert "for 3.5 s" in text
    assert "rank 1 on n0 (pid 1001): last heartbeat 12.0 s ago; step 3; last collective all_reduce #4" in text
    assert "rank 2 on n1 (pid 1002): no heartbeat yet" in text
    assert "Likely cause: rank(s) 1:" in text
    assert "stack of 0" in text and "stack of 1" in text and "did not answer in time" in text



def test_a_rank_setting_up_is_not_watched_and_its_timeout_starts_after(watch):
    writer = HeartbeatWriter(watch.path(0))
    writer.beat()  # initialize's first collective armed the watch
    writer.setting_up(True)  # ... and initialize goes on with local work
    assert watch.stalled([0], now=0.0) == []
    assert watch.stalled([0], now=100.0) == []
    writer.setting_up(False)  # initialize returned: silent from now on
    assert watch.stalled([0], now=105.0) == []
    assert watch.stalled([0], now=109.9) == []
    assert watch.stalled([0], now=111.0) == [0]

"""dsrun/runtime/observability/heartbeat.py: the rank's side of hung-rank detection ([Note: heartbeats])."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsrun.env import HEARTBEAT_FILE
from dsrun.runtime.observability import heartbeat
from dsrun.runtime.observability.heartbeat import (FILE_SIZE, HeartbeatWriter, create_heartbeat_file,
                                                   read_heartbeat, stacks_path)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def channel(tmp_path: Path) -> Path:
    path = tmp_path / "rank_0"
    create_heartbeat_file(path)
    return path


def test_a_new_file_has_no_beat_no_owner_and_no_collective(channel):
    state = read_heartbeat(channel)
    assert (state.pid, state.exiting, state.beats, state.step, state.collective) == (0, False, 0, None, None)
    assert channel.stat().st_size == FILE_SIZE and stacks_path(channel).read_bytes() == b""


def test_beats_and_steps_reach_the_reader(channel):
    writer = HeartbeatWriter(channel)
    writer.beat()
    writer.beat(step=7)
    writer.beat()
    state = read_heartbeat(channel)
    assert (state.beats, state.step) == (3, 7)  # a beat without a step keeps the last step
    assert state.last_beat > 0


def test_entering_a_collective_beats_only_after_the_first_beat(channel):
    """The first beat is a finished collective: a peer still starting up must not make its partner hung."""
    writer = HeartbeatWriter(channel)
    seq = writer.entered("all_reduce", 4, 1024)
    state = read_heartbeat(channel)
    assert state.beats == 0
    assert (state.collective.seq, state.collective.op, state.collective.group_size, state.collective.nbytes,
            state.collective.finished) == (1, "all_reduce", 4, 1024, None)
    writer.finished(seq)
    state = read_heartbeat(channel)
    assert state.beats == 1 and state.collective.finished >= state.collective.entered
    writer.entered("broadcast", 2, 8)
    state = read_heartbeat(channel)
    assert state.beats == 2 and state.collective.op == "broadcast" and state.collective.finished is None


def test_an_older_async_collective_finishing_leaves_the_newer_record_open(channel):
    writer = HeartbeatWriter(channel)
    writer.beat()
    first = writer.entered("all_reduce", 2, 4)
    writer.entered("all_gather_into_tensor", 2, 8)
    writer.finished(first)
    state = read_heartbeat(channel)
    assert state.collective.seq == 2 and state.collective.finished is None
    assert state.beats == 4  # the finish still beats


def test_long_op_names_are_cut_to_the_field(channel):
    writer = HeartbeatWriter(channel)
    writer.entered("x" * 50, 1, 0)
    assert read_heartbeat(channel).collective.op == "x" * 32


def test_a_file_that_is_not_a_heartbeat_is_refused(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"DSHB")
    with pytest.raises(ValueError, match="not a dsrun heartbeat file"):
        HeartbeatWriter(short)
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"\0" * FILE_SIZE)
    with pytest.raises(ValueError, match="magic"):
        HeartbeatWriter(foreign)
    with pytest.raises(ValueError, match="magic"):
        read_heartbeat(foreign)


def test_without_the_variable_nothing_is_watched(monkeypatch):
    monkeypatch.delenv(HEARTBEAT_FILE.name, raising=False)
    monkeypatch.setattr(heartbeat._Channel, "started", False)
    monkeypatch.setattr(heartbeat._Channel, "writer", None)
    assert heartbeat.start() is False
    heartbeat.beat()
    assert heartbeat.collective_entered("all_reduce", 2, 4) == 0
    heartbeat.collective_finished(0)


def _run(code: str, channel: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), HEARTBEAT_FILE.name: str(channel)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=60)


def test_start_claims_the_file_and_the_first_beat_starts_it_lazily(channel):
    out = _run("""
        import os
        from dsrun.runtime.observability import heartbeat
        heartbeat.beat(step=3)       # no start() before: the first beat opens the channel
        print(os.getpid())
    """, channel)
    assert out.returncode == 0, out.stderr
    state = read_heartbeat(channel)
    assert (state.pid, state.beats, state.step) == (int(out.stdout), 1, 3)
    assert state.exiting  # marked at exit: no longer watched


def test_a_file_claimed_by_another_process_is_left_to_it(channel):
    HeartbeatWriter(channel).claim(12345)
    out = _run("""
        from dsrun.runtime.observability import heartbeat
        print(heartbeat.start())
        heartbeat.beat()
    """, channel)
    assert out.stdout.strip() == "False", out.stderr
    assert read_heartbeat(channel).beats == 0


def test_an_unusable_file_is_a_warning_not_an_error(tmp_path):
    out = _run("""
        from dsrun.runtime.observability import heartbeat
        print(heartbeat.start())
    """, tmp_path / "missing")
    assert out.returncode == 0 and out.stdout.strip() == "False"
    assert "a hang of this rank will not be detected" in out.stderr


def test_a_forked_child_does_not_beat_for_the_rank(channel):
    """A data loader worker (forked after start) shares the mapping; it must not keep the rank alive."""
    out = _run("""
        import os
        from dsrun.runtime.observability import heartbeat
        heartbeat.start()
        heartbeat.beat()
        pid = os.fork()
        if pid == 0:
            heartbeat.beat(); heartbeat.beat()
            os._exit(0)
        os.waitpid(pid, 0)
    """, channel)
    assert out.returncode == 0, out.stderr
    assert read_heartbeat(channel).beats == 1


def test_the_dump_signal_writes_every_threads_stack(channel):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import threading, time
        from dsrun.runtime.observability import heartbeat
        heartbeat.start()
        def side_thread_waits():
            threading.Event().wait()
        threading.Thread(target=side_thread_waits, daemon=True).start()
        print("ready", flush=True)
        time.sleep(60)
    """)], env={**os.environ, "PYTHONPATH": str(ROOT), HEARTBEAT_FILE.name: str(channel)},
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert read_heartbeat(channel).pid == proc.pid
        os.kill(proc.pid, heartbeat.DUMP_SIGNAL)
        for _ in range(200):
            text = stacks_path(channel).read_text()
            if "<module>" in text:
                break
            time.sleep(0.02)
        assert "side_thread_waits" in text and "<module>" in text, text
        assert proc.poll() is None  # the dump does not end the rank
    finally:
        proc.kill()
        proc.wait()


def test_the_engine_beats_at_each_forward_and_step(channel):
    """dsrun.initialize starts the heartbeat (init_distributed); forward and step beat, step with its number."""
    out = _run("""
        import torch, dsrun
        model = torch.nn.Linear(3, 1)
        engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        from dsrun.runtime.observability.heartbeat import read_heartbeat
        import os
        before = read_heartbeat(os.environ["DSRUN_HEARTBEAT_FILE"]).beats
        for _ in range(3):
            loss = engine(torch.ones(2, 3)).sum()
            engine.backward(loss)
            engine.step()
        state = read_heartbeat(os.environ["DSRUN_HEARTBEAT_FILE"])
        print(before, state.beats, state.step)
    """, channel)
    assert out.returncode == 0, out.stderr
    before, beats, step = map(int, out.stdout.split())
    assert beats - before >= 6 and step == 3, out.stdout

"""Progress records: the engine on rank 0 emits them under dsrun's launcher, the head shows
them as a live bar on a terminal or as plain periodic lines, never as raw text."""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch
from rich.console import Console

from dsrun.launcher.progress import RECORD_MARK, ProgressDisplay, decode_record, encode_record
from tests.dist_helpers import run_ranks
from tests.launcher.conftest import Launcher, assert_no_leftovers

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_tiny.py")


def relayed(record: dict, rank: int = 0) -> bytes:
    return f"[rank {rank}] {encode_record(record)}\n".encode()


def test_records_round_trip_and_other_ranks_are_not_records():
    record = {"step": 3, "total": 10, "loss": 2.5, "lr": 1e-3}
    assert decode_record(relayed(record)) == record
    assert decode_record(relayed(record, rank=1)) is None  # only rank 0 drives the bar
    assert decode_record(b"[rank 0] " + RECORD_MARK.encode() + b"{not json\n") is None
    assert decode_record(b"[rank 0] loss 2.5\n") is None


def test_plain_lines_when_not_a_terminal():
    out = io.BytesIO()
    display = ProgressDisplay(out, plain_interval=3600)
    assert not display.live
    assert display.consume(relayed({"step": 1, "total": 4, "loss": 2.0, "samples_per_s": 8.0}))
    assert display.consume(relayed({"step": 2, "total": 4, "loss": 1.5}))  # within the interval: no line
    assert not display.consume(b"[rank 1] hello\n")
    display.write(out, b"[rank 1] hello\n")
    assert out.getvalue().decode().splitlines() == [
        "dsrun: progress step 1/4 (25%)  loss 2.0000  8.0 samples/s", "[rank 1] hello"]
    assert display.last == {"step": 2, "total": 4, "loss": 1.5}


def test_live_bar_keeps_other_ranks_lines_whole():
    screen = io.StringIO()
    out = io.BytesIO()
    display = ProgressDisplay(out, console=Console(file=screen, force_terminal=True, width=150))
    assert display.live
    display.consume(relayed({"step": 3, "total": 10, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 1234.0}))
    display.write(out, b"[rank 1] a line from rank 1\n")
    display.consume(relayed({"step": 7, "total": 10, "loss": 2.25, "tokens_per_s": 1234.0}))
    display.stop()
    text = screen.getvalue()
    assert "[rank 1] a line from rank 1\n" in text  # printed whole, above the bar
    assert "7/10" in text and "loss 2.2500" in text and "1,234 tokens/s" in text
    assert RECORD_MARK not in text and out.getvalue() == b""


def emit_records(steps: int) -> list[str]:
    os.environ["DSRUN_PROGRESS"] = "1"
    import dsrun

    engine, *_ = dsrun.initialize(model=torch.nn.Linear(4, 1), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": steps, "warmup_num_steps": 1}}})
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        for _ in range(steps):
            engine.backward(engine(torch.randn(2, 4)).sum())
            engine.step()
    return captured.getvalue().split("\n")[:-1]


def test_the_engine_emits_records_on_rank_0_only():
    rank0, rank1 = run_ranks(emit_records, 2, 5, timeout=120)
    assert rank1 == []
    records = [json.loads(line[len(RECORD_MARK):]) for line in rank0]
    assert all(line.startswith(RECORD_MARK) for line in rank0)
    assert records[0]["step"] == 1 and records[-1]["step"] == 5  # the first, then at most 2/s, and the last
    assert all(r["total"] == 5 and "loss" in r and r["samples_per_s"] > 0 for r in records)


@pytest.mark.slow
def test_progress_lines_under_the_launcher(tmp_path):
    launcher = Launcher(tmp_path)
    launcher.env["DSRUN_PROGRESS_INTERVAL"] = "0"
    try:
        result = launcher.run("--num_procs", "2", SCRIPT, timeout=180)
    finally:
        assert_no_leftovers(launcher.marker)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    progress = [line for line in lines if line.startswith("dsrun: progress step")]
    assert progress and progress[-1].startswith("dsrun: progress step 40/40 (100%)  loss ")
    assert RECORD_MARK.strip() not in result.stdout
    assert "[rank 0] rank 0 done" in lines and "[rank 1] rank 1 done" in lines

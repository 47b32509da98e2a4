"""wall_clock_breakdown: the per-phase line and DeepSpeed's elapsed-time events; the comms summary."""
from __future__ import annotations

import io
import logging
import re

import pytest
import torch
from rich.console import Console

from dsrun.runtime.comm import logger as comm_logger
from tests.dist_helpers import run_ranks
from tests.monitor.test_monitors import VOCAB, TokenModel, read_csv

LINE = re.compile(r"step (\d+) \| time per step \(ms, mean of (\d+)\): forward [\d.]+ \| "
                  r"backward [\d.]+ \(collectives ([\d.]+)\) \| step [\d.]+.* \| total ([\d.]+) \| "
                  r"collectives ([\d.]+) ms = (\d+)% \| ([\d.]+) MiB sent")


def breakdown_run(out_dir: str) -> list[str]:
    import dsrun
    from dsrun.runtime.observability.logging import logger

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    torch.manual_seed(0)
    engine, *_ = dsrun.initialize(model=TokenModel(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "wall_clock_breakdown": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "wcb"}})
    for _ in range(4):
        engine.backward(engine(torch.randint(0, VOCAB, (2, 6))))
        engine.step()
    return [line for line in lines if "time per step" in line]


def test_wall_clock_breakdown_prints_phases_and_the_collectives_share(tmp_path):
    rank0, rank1 = run_ranks(breakdown_run, 2, str(tmp_path), timeout=120)
    assert rank1 == []  # rank 0 prints
    assert len(rank0) == 2
    for line, step in zip(rank0, (2, 4)):
        m = LINE.match(line)
        assert m, line
        assert int(m.group(1)) == step and int(m.group(2)) == 2
        assert 0 <= float(m.group(3)) <= float(m.group(4))  # (the unrounded > 0 check is on the events below)
        total, comm, share = float(m.group(4)), float(m.group(5)), int(m.group(6))
        # the line rounds milliseconds to 0.1 and the share to a whole percent
        lowest, highest = 100 * (comm - 0.05) / (total + 0.05), 100 * (comm + 0.05) / max(total - 0.05, 1e-9)
        assert comm <= total and lowest - 0.5 <= share <= highest + 0.5
    events = {name: read_csv(tmp_path / "wcb", f"Train/Samples/elapsed_time_ms_{name}")[1]
              for name in ("forward", "backward", "backward_inner", "backward_allreduce", "step")}
    assert all(len(v) == 4 for v in events.values())
    assert [i + a for i, a in zip(events["backward_inner"], events["backward_allreduce"])] == \
        pytest.approx(events["backward"])
    assert all(a > 0 for a in events["backward_allreduce"])


def test_log_summary_prints_deepspeed_style_table(monkeypatch):
    cl = comm_logger.CommsLogger()
    monkeypatch.setattr(comm_logger, "comms_logger", cl)
    cl.configure(enabled=True)
    cl.record("all_reduce", torch.ones(2**18), seconds=0.002, group_size=2)  # 1 MiB
    cl.record_wait("all_reduce", 0.002)
    cl._console = Console(file=io.StringIO(), width=200)
    comm_logger.log_summary()
    row = next(line for line in cl._console.file.getvalue().splitlines() if "all_reduce" in line)
    cells = [c.strip() for c in re.split(r"[│|]", row) if c.strip()]
    # op, calls, MiB, avg KiB, bus MiB, sync s, wait s, algbw GB/s (1 MiB / 4 ms), busbw (x 2(p-1)/p = 1)
    assert cells == ["all_reduce", "1", "1.00", "1024.0", "1.00", "0.0020", "0.0020", "0.262", "0.262"]
    with pytest.raises(ValueError, match="show_straggler"):
        comm_logger.log_summary(show_straggler=True)

"""Result files, metrics, failure reasons and the summary (results.py, report.py)."""
from __future__ import annotations

import json

import pytest

from dsrun.autotuning.report import (
    OPTIMAL_NAME,
    TrialRecord,
    best_record,
    write_optimal,
    write_summary,
)
from dsrun.autotuning.results import ResultError, failure_reason, read_result
from dsrun.autotuning.space import Candidate
from dsrun.runtime.config import load_config
from tests.autotuning.helpers import MIB, result, write_result


def test_result_file_round_trips_and_gives_the_metrics(tmp_path):
    path = tmp_path / "result.json"
    write_result(path, result(step_seconds=(0.2, 0.6), tokens=4000))
    r = read_result(path)
    assert r.step_time == pytest.approx(0.4)
    assert r.samples_per_s == pytest.approx(32 / 0.4)
    assert r.flops_per_s == pytest.approx(6 * 10_000_000 * 4000 / 0.8 / 2)
    assert r.peak == 320 * MIB
    assert r.score("latency") == pytest.approx(-0.4) and r.score("throughput") == pytest.approx(80)
    assert result().flops_per_s is None and result().score("flops") is None


def test_bad_result_files_name_the_problem(tmp_path):
    path = tmp_path / "result.json"
    with pytest.raises(ResultError, match="not a trial result"):
        read_result(path)
    path.write_text(json.dumps({"world_size": 2}))
    with pytest.raises(ResultError, match="needs field 'ranks_per_node'"):
        read_result(path)
    write_result(path, result(step_seconds=()))
    with pytest.raises(ResultError, match="no timed step"):
        read_result(path)


def test_failure_reasons():
    assert failure_reason(137, "", 5) == "out of memory (killed by SIGKILL)"
    assert failure_reason(1, "[rank 1] torch.OutOfMemoryError: CUDA out of memory. Tried ...\ndsrun: rank 1 failed",
                          5).startswith("out of memory: [rank 1] torch.OutOfMemoryError")
    text = "[rank 0] Traceback ...\n[rank 0] ValueError: bad batch\ndsrun: job failed: rank 0 exited with 1\n"
    assert failure_reason(1, text, 5) == "exit status 1: [rank 0] ValueError: bad batch"
    assert "before optimizer step 5" in failure_reason(0, "", 5)
    assert failure_reason(2, "", 5) == "exit status 2: (no error output)"


def test_best_record_is_the_best_successful_score():
    fast, slow = result(step_seconds=(0.1,)), result(step_seconds=(0.3,))
    records = [TrialRecord(Candidate(0, 2, 8), "ok", slow, baseline=True),
               TrialRecord(Candidate(1, 4, 4), "ok", fast), TrialRecord(Candidate(2, 8, 2), "failed", None, "oom"),
               TrialRecord(Candidate(3, 16, 1), "pruned", None, "needs 9 GiB")]
    assert best_record(records, "throughput") is records[1]
    assert best_record(records, "latency") is records[1]
    assert best_record(records[2:], "throughput") is None


def test_summary_lists_every_trial_and_the_optimal_config_loads(tmp_path):
    records = [TrialRecord(Candidate(0, 2, 8), "ok", result(step_seconds=(0.3,)), baseline=True),
               TrialRecord(Candidate(1, 4, 4), "ok", result(step_seconds=(0.1,))),
               TrialRecord(Candidate(2, 8, 2), "failed", None, "exit status 3: [rank 0] too big"),
               TrialRecord(Candidate(3, 16, 1), "pruned", None, "needs ~9.00 GiB of RAM per node")]
    best = best_record(records, "throughput")
    text = write_summary(tmp_path, records, "throughput", best).read_text()
    for name in ("baseline z0_mbs2_gas8", "* z1_mbs4_gas4", "z2_mbs8_gas2", "z3_mbs16_gas1", "[rank 0] too big",
                 "needs ~9.00 GiB", "300.0 ms", "320 MiB", "320.0", "best: z1_mbs4_gas4"):
        assert name in text, name
    rows = json.loads((tmp_path / "summary.json").read_text())["trials"]
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "pruned"]
    assert [r["best"] for r in rows] == [False, True, False, False]
    assert rows[1]["samples_per_s"] == pytest.approx(320) and rows[1]["peak_memory_per_rank"] == [320 * MIB, 318 * MIB]

    base = {"train_batch_size": 32, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    path = write_optimal(tmp_path, best.candidate.apply(base, 2))
    assert path.name == OPTIMAL_NAME
    cfg = load_config(path, world_size=2)
    assert (cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
        (1, 4, 4)
    assert not cfg.autotuning.enabled

"""`train_gpt.py --tensor_parallel`: the byte GPT under AutoTP (dsrun.tp_model_init).

The slow tests run train_gpt.py through `dsrun`: tp=2 on 2 ranks (one model
copy, so one data-parallel replica) against one rank training the unsharded
GPT on the same windows from the same weights, and pipe=2 x tp=2 on 4 ranks
against the 2-stage pipeline on 2 ranks. The fast test checks the flag's
refusals.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from train_gpt import parse_args

SUMMARY = re.compile(r"validation loss: before (\d+\.\d+)\s+after (\d+\.\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, num_procs: int, steps: int, *flags: str,
            config_name: str = "gpt_demo.json", drop: tuple[str, ...] = ()) -> tuple[float, float]:
    """train_gpt.py shortened to `steps` via dsrun, the config's keys `drop`
    removed; (validation loss before, after) from rank 0."""
    cfg = json.loads((EXAMPLES / "configs" / config_name).read_text())
    cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=4)
    for key in drop:
        del cfg[key]
    cfg_path = tmp_path / config_name
    cfg_path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", str(num_procs),
           "--master_port", str(_free_port()), str(EXAMPLES / "train_gpt.py"),
           "--config", str(cfg_path), "--steps", str(steps), "--n_layer", "2", "--n_embd", "64",
           "--seq_len", "64", "--eval_batches", "4", *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    found = SUMMARY.findall(out)
    assert len(found) == 1, f"expected one summary line from rank 0:\n{out}"
    return float(found[0][0]), float(found[0][1])


def test_tensor_parallel_flag_refusals(capsys):
    for argv, message in ((["--tensor_parallel", "0"], "--tensor_parallel must be >= 1"),
                          (["--tensor_parallel", "3", "--n_head", "4"], "must divide --n_head 4")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert parse_args(["--tensor_parallel", "2"]).tensor_parallel == 2


@pytest.mark.slow
def test_tensor_parallel_matches_one_rank_on_the_same_windows(tmp_path):
    """tp=2 on 2 ranks draws data-parallel rank 0's windows (micro-batch 16,
    global batch 16) as a single rank does, from the same weights (rank 0's,
    broadcast and sliced), and the 32 validation windows are the same: the
    losses must agree to the printed 4 decimals (the sharded matmuls and the
    all-reduce change only the order of fp32 sums)."""
    tp = _launch(tmp_path, 2, 20, "--tensor_parallel", "2")
    single = _launch(tmp_path, 1, 20)
    assert 5.0 < tp[0] < 5.7  # an untrained byte model scores about ln 256 = 5.55
    assert tp[0] - tp[1] > 1.0, tp
    assert tp == pytest.approx(single, abs=2e-4)


@pytest.mark.slow
def test_pipeline_x_tensor_parallel_matches_the_pipeline(tmp_path):
    """pipe=2 x tp=2 on 4 ranks against pipe=2 on 2 ranks (gpt_pipe.json:
    one replica, 4 micro-batches of 8 per step): the same windows and
    weights, so the same losses to the printed 4 decimals."""
    both = _launch(tmp_path, 4, 20, "--pipeline_stages", "2", "--tensor_parallel", "2", config_name="gpt_pipe.json")
    pipe = _launch(tmp_path, 2, 20, "--pipeline_stages", "2", config_name="gpt_pipe.json")
    assert both[0] - both[1] > 1.0, both
    assert both == pytest.approx(pipe, abs=2e-4)

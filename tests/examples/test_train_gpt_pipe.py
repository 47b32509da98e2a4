"""The byte GPT as a pipeline (examples/gpt_pipe.py) and `train_gpt.py --pipeline_stages`.

The unit test checks the pipeline form computes the GPT's function from the
GPT's weights. The slow tests run train_gpt.py through `dsrun`: 2 ranks as 2
pipeline stages learn; pipe=2 x data=2 trains as 2 data-parallel ranks do on
the same windows at the same global batch (32 windows).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from gpt_model import GPT, GPTConfig  # noqa: E402
from gpt_pipe import TIED_KEY, gpt_pipeline, load_gpt_weights, lm_loss  # noqa: E402

SUMMARY = re.compile(r"validation loss: before (\d+\.\d+)\s+after (\d+\.\d+)")


def test_pipeline_form_computes_the_gpt_from_its_weights():
    cfg = GPTConfig(seq_len=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    pipe = gpt_pipeline(cfg, num_stages=1)  # one process: every layer on this rank
    load_gpt_weights(pipe, gpt)
    idx, targets = torch.randint(0, 256, (3, 16)), torch.randint(0, 256, (3, 16))
    out = pipe(idx)
    assert out.shape == (3, 16, 256)
    torch.testing.assert_close(out, gpt(idx), rtol=0, atol=0)
    torch.testing.assert_close(lm_loss(out, targets), gpt(idx, targets), rtol=0, atol=0)
    # the output projection is the embedding's module: one tensor, used at both ends
    assert list(pipe.tied_modules) == [TIED_KEY] and pipe.tied_modules[TIED_KEY].weight.shape == (256, 32)
    assert sum(p.numel() for p in pipe.parameters()) == sum(p.numel() for p in gpt.parameters())
    with pytest.raises(ValueError, match="no weights for"):
        load_gpt_weights(gpt_pipeline(GPTConfig(seq_len=16, n_layer=3, n_head=2, n_embd=32), 1), gpt)


def _launch(tmp_path: Path, num_procs: int, config_name: str, steps: int, *flags: str) -> tuple[float, float]:
    """train_gpt.py shortened to `steps` via dsrun; (validation loss before, after) as rank 0 prints them."""
    cfg = json.loads((EXAMPLES / "configs" / config_name).read_text())
    cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=4)
    cfg_path = tmp_path / config_name
    cfg_path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", str(num_procs), str(EXAMPLES / "train_gpt.py"),
           "--config", str(cfg_path), "--steps", str(steps), "--n_layer", "2", "--n_embd", "64",
           "--seq_len", "64", *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    found = SUMMARY.findall(out)
    assert len(found) == 1, f"expected one summary line from rank 0:\n{out}"
    return float(found[0][0]), float(found[0][1])


@pytest.mark.slow
def test_two_stage_pipeline_on_two_ranks_trains(tmp_path):
    before, after = _launch(tmp_path, 2, "gpt_pipe.json", 20, "--pipeline_stages", "2", "--eval_batches", "4")
    assert 5.0 < before < 5.7  # an untrained byte model scores about ln 256 = 5.55
    assert before - after > 1.0, (before, after)


@pytest.mark.slow
def test_pipeline_matches_data_parallel_on_the_same_windows(tmp_path):
    """pipe=2 x data=2 (gpt_pipe.json: micro-batch 8 x 2 per replica) against 2
    data-parallel ranks (gpt_demo.json: micro-batch 16): replica r draws the
    same 16 windows per step as data-parallel rank r, from the same weights, so
    the runs must agree to the printed 4 decimals (64 validation windows each)."""
    pipe = _launch(tmp_path, 4, "gpt_pipe.json", 20, "--pipeline_stages", "2", "--eval_batches", "8")
    data_parallel = _launch(tmp_path, 2, "gpt_demo.json", 20, "--eval_batches", "4")
    assert pipe[0] - pipe[1] > 1.0, pipe
    assert pipe == pytest.approx(data_parallel, abs=2e-4)

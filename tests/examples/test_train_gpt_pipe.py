"""The byte GPT as a pipeline (examples/gpt_pipe.py) and `train_gpt.py --pipeline_stages`.

The unit test checks the pipeline form computes the GPT's function from the
GPT's weights. The slow tests run train_gpt.py through `dsrun`: 2 ranks as 2
pipeline stages learn; pipe=2 x data=2 trains as 2 data-parallel ranks do on
the same windows at the same global batch (32 windows).
"""
from __future__ import annotations

import sys

import pytest
import torch

from tests.examples.gpt_runs import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

from gpt_model import GPT, GPTConfig  # noqa: E402
from gpt_pipe import TIED_KEY, gpt_pipeline, load_gpt_weights, lm_loss  # noqa: E402


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


@pytest.mark.slow
def test_two_stage_pipeline_on_two_ranks_trains(gpt_run):
    """The run is also test_train_gpt_tp.py's reference for pipe=2 x tp=2 (one launch for both)."""
    before, after, _ = gpt_run(2, 20, "--pipeline_stages", "2", config_name="gpt_pipe.json")
    assert 5.0 < before < 5.7  # an untrained byte model scores about ln 256 = 5.55
    assert before - after > 1.0, (before, after)


@pytest.mark.slow
def test_pipeline_matches_data_parallel_on_the_same_windows(gpt_run):
    """pipe=2 x data=2 (gpt_pipe.json: micro-batch 8 x 2 per replica) against 2
    data-parallel ranks (gpt_demo.json: micro-batch 16): replica r draws the
    same 16 windows per step as data-parallel rank r, from the same weights, so
    the runs must agree to the printed 4 decimals (64 validation windows each)."""
    pipe = gpt_run(4, 20, "--pipeline_stages", "2", config_name="gpt_pipe.json", eval_batches=8)[:2]
    data_parallel = gpt_run(2, 20)[:2]  # also test_demo.py's stage-0 run
    assert pipe[0] - pipe[1] > 1.0, pipe
    assert pipe == pytest.approx(data_parallel, abs=2e-4)

"""`train_gpt.py --tensor_parallel`: the byte GPT under AutoTP (dsrun.tp_model_init).

The slow tests run train_gpt.py through `dsrun`: tp=2 on 2 ranks (one model
copy, so one data-parallel replica) against one rank training the unsharded
GPT on the same windows from the same weights, and pipe=2 x tp=2 on 4 ranks
against the 2-stage pipeline on 2 ranks. The fast test checks the flag's
refusals.
"""
from __future__ import annotations

import sys

import pytest

from tests.examples.gpt_runs import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

from train_gpt import parse_args


def test_tensor_parallel_flag_refusals(capsys):
    for argv, message in ((["--tensor_parallel", "0"], "--tensor_parallel must be >= 1"),
                          (["--tensor_parallel", "3", "--n_head", "4"], "must divide --n_head 4")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert parse_args(["--tensor_parallel", "2"]).tensor_parallel == 2


@pytest.mark.slow
def test_tensor_parallel_matches_one_rank_on_the_same_windows(gpt_run):
    """tp=2 on 2 ranks draws data-parallel rank 0's windows (micro-batch 16,
    global batch 16) as a single rank does, from the same weights (rank 0's,
    broadcast and sliced), and the 32 validation windows are the same: the
    losses must agree to the printed 4 decimals (the sharded matmuls and the
    all-reduce change only the order of fp32 sums)."""
    tp = gpt_run(2, 20, "--tensor_parallel", "2")[:2]
    single = gpt_run(1, 20)[:2]  # also test_train_gpt_sp.py's reference
    assert 5.0 < tp[0] < 5.7  # an untrained byte model scores about ln 256 = 5.55
    assert tp[0] - tp[1] > 1.0, tp
    assert tp == pytest.approx(single, abs=2e-4)


@pytest.mark.slow
def test_pipeline_x_tensor_parallel_matches_the_pipeline(gpt_run):
    """pipe=2 x tp=2 on 4 ranks against pipe=2 on 2 ranks (gpt_pipe.json:
    one replica, 4 micro-batches of 8 per step): the same windows and
    weights, so the same losses to the printed 4 decimals."""
    both = gpt_run(4, 20, "--pipeline_stages", "2", "--tensor_parallel", "2", config_name="gpt_pipe.json")[:2]
    pipe = gpt_run(2, 20, "--pipeline_stages", "2", config_name="gpt_pipe.json")[:2]  # test_train_gpt_pipe.py's too
    assert both[0] - both[1] > 1.0, both
    assert both == pytest.approx(pipe, abs=2e-4)

"""`train_gpt.py --sequence_parallel`: the byte GPT under Ulysses
(examples/gpt_sequence.py). The slow test runs it through `dsrun` on 2
ranks (sequence=2, one data replica) against one rank on the same windows
from the same weights; the fast test checks the flag's refusals."""
from __future__ import annotations

import sys

import pytest

from tests.examples.gpt_runs import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

from train_gpt import parse_args


def test_sequence_parallel_flag_refusals(capsys):
    for argv, message in ((["--sequence_parallel", "0"], "--sequence_parallel must be >= 1"),
                          (["--sequence_parallel", "3", "--n_head", "6", "--seq_len", "64"], "must divide"),
                          (["--sequence_parallel", "2", "--tensor_parallel", "2"], "data parallelism only")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert parse_args(["--sequence_parallel", "2"]).sequence_parallel == 2


@pytest.mark.slow
def test_sequence_parallel_matches_one_rank_on_the_same_windows(gpt_run):
    """sp=2 on 2 ranks draws data-parallel rank 0's windows, as one rank
    does, from the same weights: 20 steps (the one-rank run is
    test_train_gpt_tp.py's reference too) give the same validation losses
    to the printed 4 decimals (the all-to-alls only reorder fp32 sums), and
    training lowers the loss."""
    sp = gpt_run(2, 20, "--sequence_parallel", "2")[:2]
    single = gpt_run(1, 20)[:2]
    assert 5.0 < sp[0] < 5.7  # an untrained byte model scores about ln 256 = 5.55
    assert sp[1] < sp[0], sp
    assert sp == pytest.approx(single, abs=2e-4)

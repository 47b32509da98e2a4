"""`train_gpt.py --config configs/gpt_4d.json`: pipe 2 x tensor 2 x
sequence 2 read from the config alone (no degree flag). The slow test runs
it through `dsrun` on 8 ranks against the same config without its tensor
and sequence keys on 2 ranks (pipe 2), the same global batch and weights;
the fast test checks how the degrees are read and the flags refused."""
from __future__ import annotations

import sys

import pytest

from tests.examples.gpt_runs import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

from train_gpt import config_degrees, declared_pipeline, parse_args

CONFIG = str(EXAMPLES / "configs" / "gpt_4d.json")


def test_degrees_come_from_the_config_and_flags_are_refused():
    assert config_degrees(parse_args(["--config", CONFIG])) == (2, 2, 2)
    assert config_degrees(parse_args([])) == (1, 1, 1)
    args = parse_args(["--config", CONFIG, "--tensor_parallel", "2"])
    with pytest.raises(SystemExit, match="the degrees come from the config"):
        declared_pipeline(args, None, (2, 2, 2))  # refused before any process group exists


@pytest.mark.slow
def test_gpt_4d_matches_the_pipeline_on_fewer_ranks(gpt_run):
    """8 ranks (one data replica) draw data-parallel rank 0's windows, as the
    2-rank pipeline does, from the same GPT weights: the validation losses
    agree to the printed 4 decimals, and training lowers the loss."""
    four_d = gpt_run(8, 12, config_name="gpt_4d.json")[:2]
    pipe = gpt_run(2, 12, "--pipeline_stages", "2", config_name="gpt_4d.json",
                   drop=("tensor_parallel", "sequence_parallel_size"))[:2]
    assert 5.0 < four_d[0] < 5.7  # an untrained byte model scores about ln 256 = 5.55
    assert four_d[1] < four_d[0], four_d
    assert four_d == pytest.approx(pipe, abs=2e-4)

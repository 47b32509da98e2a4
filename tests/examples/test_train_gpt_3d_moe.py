"""`train_gpt.py --config configs/gpt_3d_moe.json`: pipe 2 x tensor 2 x data
2 with MoE experts at ep 2 read from the config alone (no flag). The slow
test runs it through `dsrun` on 8 ranks against the same config without its
tensor key on 4 ranks (pipe 2 x data 2, the MoE flags given), the same global
batch and weights; the fast test checks how the MoE defaults are read."""
from __future__ import annotations

import sys

import pytest

from tests.examples.gpt_runs import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

from train_gpt import DECLARED_EP_SIZE, DECLARED_EXPERTS, config_degrees, parse_args

CONFIG = str(EXAMPLES / "configs" / "gpt_3d_moe.json")


def test_the_config_declares_pipe_x_tensor_and_the_moe_defaults_follow():
    args = parse_args(["--config", CONFIG])
    assert config_degrees(args) == (2, 2, 1)
    assert (args.moe_experts, args.moe_ep_size) == (DECLARED_EXPERTS, DECLARED_EP_SIZE) == (4, 2)
    assert (parse_args(["--config", CONFIG, "--moe_experts", "2", "--moe_ep_size", "1"]).moe_experts) == 2
    gpt_4d = parse_args(["--config", str(EXAMPLES / "configs" / "gpt_4d.json")])  # sequence parallel: dense
    assert (gpt_4d.moe_experts, gpt_4d.moe_ep_size) == (0, 1)
    assert (parse_args([]).moe_experts, parse_args([]).moe_ep_size) == (0, 1)


@pytest.mark.slow
def test_gpt_3d_moe_matches_the_moe_pipeline_on_fewer_ranks(gpt_run):
    """8 ranks (2 data replicas, each pipe 2 x tensor 2, the experts over the
    2 data ranks and kept whole over the tensor ranks) train as 4 ranks (pipe
    2 x data 2, the same experts) do from the same weights on the same
    windows: the validation losses agree to the printed 4 decimals, and
    training lowers the loss."""
    three_d = gpt_run(8, 12, config_name="gpt_3d_moe.json")[:2]
    pipe = gpt_run(4, 12, "--pipeline_stages", "2", "--moe_experts", "4", "--moe_ep_size", "2",
                   config_name="gpt_3d_moe.json", drop=("tensor_parallel",))[:2]
    assert 5.0 < three_d[0] < 5.7  # an untrained byte model scores about ln 256 = 5.55
    assert three_d[1] < three_d[0], three_d
    assert three_d == pytest.approx(pipe, abs=2e-4)

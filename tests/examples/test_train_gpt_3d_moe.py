"""`train_gpt.py --config configs/gpt_3d_moe.json`: pipe 2 x tensor 2 x data
2 with MoE experts at ep 2 read from the config alone (no flag): the degrees
from dsrun's keys, the experts from the script's own "train_gpt" section,
which dsrun never sees. The slow test runs it through `dsrun` on 8 ranks
against the same config without its tensor key on 4 ranks (pipe 2 x data 2),
the same global batch and weights; the fast ones check how the section is
read."""
from __future__ import annotations

import json
import sys
import warnings

import pytest

from tests.examples.gpt_runs import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

from train_gpt import SCRIPT_SECTION, config_degrees, parse_args, run_config

CONFIG = str(EXAMPLES / "configs" / "gpt_3d_moe.json")


def test_the_config_declares_the_layout_and_the_script_section_the_experts():
    args = parse_args(["--config", CONFIG])
    assert config_degrees(args) == (2, 2, 1)
    assert (args.moe_experts, args.moe_ep_size, args.moe_top_k) == (4, 2, 1)
    flagged = parse_args(["--config", CONFIG, "--moe_experts", "2", "--moe_ep_size", "1"])  # a flag wins
    assert (flagged.moe_experts, flagged.moe_ep_size) == (2, 1)
    gpt_4d = parse_args(["--config", str(EXAMPLES / "configs" / "gpt_4d.json")])  # no section: dense
    assert (gpt_4d.moe_experts, gpt_4d.moe_ep_size) == (0, 1)
    assert (parse_args([]).moe_experts, parse_args([]).moe_ep_size) == (0, 1)


def test_dsrun_never_sees_the_script_section():
    """run_config (what initialize and init_distributed get) has no
    "train_gpt" key, so dsrun's config reader has nothing to warn about."""
    from dsrun.runtime.config import load_config
    config = run_config(parse_args(["--config", CONFIG, "--steps", "3"]))
    assert SCRIPT_SECTION not in config
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unknown key would be a ConfigWarning
        load_config(config, world_size=2)  # the data-parallel ranks of pipe 2 x tensor 2 on 8


@pytest.mark.parametrize("section,message", [({"moe_expert": 4}, "unknown keys ['moe_expert']"),
                                             ({"moe_experts": "4"}, "must be integers"),
                                             ([4], "must be an object")])
def test_a_bad_script_section_is_a_usage_error(tmp_path, capsys, section, message):
    config = json.loads((EXAMPLES / "configs" / "gpt_3d_moe.json").read_text())
    config[SCRIPT_SECTION] = section
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path)])
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_gpt_3d_moe_matches_the_moe_pipeline_on_fewer_ranks(gpt_run):
    """8 ranks (2 data replicas, each pipe 2 x tensor 2, the experts over the
    2 data ranks and kept whole over the tensor ranks) train as 4 ranks (pipe
    2 x data 2, the same experts) do from the same weights on the same
    windows: the validation losses agree to the printed 4 decimals, and
    training lowers the loss."""
    three_d = gpt_run(8, 12, config_name="gpt_3d_moe.json")[:2]
    pipe = gpt_run(4, 12, "--pipeline_stages", "2", config_name="gpt_3d_moe.json",
                   drop=("tensor_parallel",))[:2]  # the experts (4 at ep 2) from the same section
    assert 5.0 < three_d[0] < 5.7  # an untrained byte model scores about ln 256 = 5.55
    assert three_d[1] < three_d[0], three_d
    assert three_d == pytest.approx(pipe, abs=2e-4)

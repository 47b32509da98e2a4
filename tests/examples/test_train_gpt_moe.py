"""`train_gpt.py --moe_experts`: the byte GPT with MoE MLPs in alternate blocks (examples/gpt_moe.py).

The slow test trains it through `dsrun` on 2 ranks with the experts spread
over both (ep_size 2) at ZeRO stage 2; the fast tests check the flags'
refusals and the model's layout.
"""
from __future__ import annotations

import json
import sys

import pytest

from tests.examples.gpt_runs import EXAMPLES, launch

sys.path.insert(0, str(EXAMPLES))

from train_gpt import parse_args


def test_moe_flag_refusals(capsys):
    for argv, message in ((["--moe_experts", "-1"], "--moe_experts must be >= 0"),
                          (["--moe_experts", "4", "--moe_ep_size", "3"], "--moe_ep_size 3 must divide"),
                          (["--moe_experts", "4", "--moe_top_k", "5"], "--moe_top_k must be between 1 and"),
                          (["--moe_experts", "4", "--tensor_parallel", "2"], "drop --tensor_parallel and --sequence_parallel"),
                          (["--moe_experts", "4", "--n_layer", "1"], "--n_layer >= 2")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    args = parse_args(["--moe_experts", "8", "--moe_ep_size", "2", "--moe_top_k", "2"])
    assert (args.moe_experts, args.moe_ep_size, args.moe_top_k) == (8, 2, 2)


def test_moe_gpt_has_moe_mlps_in_odd_blocks_and_adds_l_aux_in_training():
    import torch
    from gpt_model import GPTConfig
    from gpt_moe import AUX_LOSS_COEF, MoEGPT, MoEMLP
    torch.manual_seed(0)
    model = MoEGPT(GPTConfig(seq_len=16, n_layer=4, n_head=2, n_embd=16), num_experts=4, k=2)
    assert [isinstance(b.mlp, MoEMLP) for b in model.blocks] == [False, True, False, True]
    idx = torch.randint(0, 256, (2, 16))
    torch.manual_seed(1)  # the same gating noise in both forwards
    loss = model(idx, idx)
    torch.manual_seed(1)
    logits = model(idx)
    aux = sum(float(m.l_aux.detach()) for m in model.moe_mlps)
    ce = torch.nn.functional.cross_entropy(logits.view(32, -1), idx.reshape(32))
    assert float(loss) == pytest.approx(float(ce) + AUX_LOSS_COEF * aux, rel=1e-6) and aux > 0


@pytest.mark.slow
def test_moe_gpt_trains_on_2_ranks_with_expert_parallelism(tmp_path):
    """4 experts top-2 over 2 expert-parallel ranks at ZeRO stage 2, 20 steps:
    the validation loss starts near ln 256 and drops."""
    cfg = json.loads((EXAMPLES / "configs" / "gpt_demo.json").read_text())
    cfg["zero_optimization"] = {"stage": 2}
    name = "gpt_moe_test.json"  # an absolute path: launch shortens the scheduler of this copy
    (tmp_path / name).write_text(json.dumps(cfg))
    before, after, _ = launch(tmp_path, 2, 20, "--moe_experts", "4", "--moe_ep_size", "2", "--moe_top_k", "2",
                              config_name=str(tmp_path / name))
    assert 5.0 < before < 5.7
    assert before - after > 0.5, (before, after)

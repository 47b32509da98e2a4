"""DeepSpeedExamples' CIFAR-10 MoE script shape (scripts/cifar10_moe.py) runs
under `dsrun` on 2 ranks with the experts spread over both."""
from __future__ import annotations

import pytest

from tests.compat.test_scripts import SCRIPTS, dsrun, results

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage,residual", [(0, "standard"), (2, "residual")])
def test_cifar10_moe_script(tmp_path, stage, residual):
    """2 experts, ep_size 2, top-1 with RSample noise and min_capacity 0, as
    the example's run_ds_moe.sh: both ranks train 2 epochs of 2 steps each,
    and dsrun warns once (rank 0), naming the layer, that the loss leaves
    l_aux out (the script discards it)."""
    run = dsrun("--num_procs", "2", str(SCRIPTS / "cifar10_moe.py"), "--deepspeed", "--moe", "--ep-world-size", "2",
                "--num-experts", "2", "--top-k", "1", "--min-capacity", "0", "--noisy-gate-policy", "RSample",
                "--moe-param-group", "--mlp-type", residual, "--stage", str(stage), cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = results(run.stdout)
    assert sorted(got) == [0, 1]
    for r in got.values():
        assert r["steps"] == 8 and len(r["losses"]) == 8 and r["groups"] == 2  # dense + one expert group
    out = run.stdout + run.stderr
    assert out.count("MoE layer moe_layer_list.0: this backward did not reach its auxiliary loss") == 1

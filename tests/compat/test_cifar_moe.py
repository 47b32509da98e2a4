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


# DeepSpeed 0.19.8's losses for the run below (torch 2.13.0+cpu, DS_ACCELERATOR=cpu, torchrun on 2
# ranks, `cifar10_moe.py` with `import deepspeed`): the same at ep 1 and 2, ZeRO 0 and 2.
DEEPSPEED_0_19_8_LOSSES = {
    0: [2.309365749359131, 2.3153929710388184, 2.312190294265747, 2.3164000511169434,
        2.2483081817626953, 2.2528076171875, 2.278552293777466, 2.206296682357788],
    1: [2.3576202392578125, 2.3107972145080566, 2.3261940479278564, 2.289679527282715,
        2.2713983058929443, 2.2906055450439453, 2.2543792724609375, 2.2011795043945312],
}


@pytest.mark.parametrize("ep,stage", [(2, 0), (1, 2)])
def test_cifar10_moe_over_capacity_matches_deepspeed_losses(tmp_path, ep, stage):
    """4 experts, top-1, capacity factor 2.0, min_capacity 4, use_rts=False:
    8 tokens per rank give 4 slots per expert, so experts overflow and the
    losses depend on which tokens are kept. dsrun keeps DeepSpeed's
    (torch.topk of the choice mask) and follows DeepSpeed's losses for all 8
    steps (within 3e-5 here); keeping the first tokens in order instead is
    1e-3 off at step 1 and 1.3% off by step 8. One epoch of 128 images:
    DeepSpeed's loader does not reshuffle between epochs, dsrun's does."""
    run = dsrun("--num_procs", "2", str(SCRIPTS / "cifar10_moe.py"), "--deepspeed", "--moe", "--ep-world-size",
                str(ep), "--num-experts", "4", "--top-k", "1", "--min-capacity", "4", "--capacity-factor", "2.0",
                "--no-rts", "--stage", str(stage), "--epochs", "1", "--images", "128", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = results(run.stdout)
    assert sorted(got) == [0, 1]
    for rank, want in DEEPSPEED_0_19_8_LOSSES.items():
        assert got[rank]["losses"] == pytest.approx(want, rel=1e-4, abs=0)

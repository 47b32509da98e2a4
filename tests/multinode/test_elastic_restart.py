"""`dsrun --max_restarts` with DeepSpeed's `elasticity` section: a restart on fewer ranks keeps the elastic
global batch and resumes the checkpoint (issue 28 items 1-3 together).

The job of test_ssh_restart.py (2 SSH nodes x 2 ranks; a rank of node-b
SIGKILLs itself in step 4 after making node-b unreachable, so the restart
runs on node-a's 2 ranks), but its batch sizes come from
`"elasticity": {"enabled": true, "max_train_batch_size": 12,
"micro_batch_sizes": [1], "min_gpus": 1, "max_gpus": 4, "version": 0.1}`
and no train_batch_size: compute_elastic_config gives a global batch of 12,
valid on 1-4 ranks, micro-batch 1, so 3 micro-batches per rank on 4 ranks
and 6 on 2. The restart must keep 12, load step 3's checkpoint written by 4
ranks, and end within LOSS_RTOL of an uninterrupted elastic 4-rank run.
(A local launch cannot shrink: its one host always passes the pre-check and
keeps its --num_procs slots, hence the SSH nodes.)
"""
from __future__ import annotations

import pytest

from dsrun.elasticity import compute_elastic_config
from tests.multinode.test_ssh_restart import LOSS_RTOL, records, run_losing_node_b

pytestmark = pytest.mark.slow

ELASTICITY = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [1], "min_gpus": 1, "max_gpus": 4,
              "version": 0.1}  # as restart_train.py --elastic writes it


def test_the_elastic_config_allows_both_world_sizes_with_one_global_batch():
    """The premise of the restart test below, from the public function."""
    for world in (4, 2):
        batch, valid, micro = compute_elastic_config({"elasticity": ELASTICITY}, "0.16.5", world_size=world,
                                                     return_microbatch=True)
        assert (batch, micro) == (12, 1) and {2, 4} <= set(valid)


def test_elastic_restart_on_fewer_ranks_keeps_the_global_batch(sshd_cluster, tmp_path):
    log, cut, whole = run_losing_node_b(sshd_cluster, tmp_path, "--elastic")
    assert "dsrun: dropping host node-b" in log, log[-3000:]
    assert "auto_resume: resumed from step 3" in log and "on 2 rank(s)" in log, log[-3000:]

    steps, weights = records(cut)
    ref_steps, ref_weights = records(whole)
    assert [(r["step"], r["world"], r["restart"], r["batch"], r["gas"]) for r in steps] == [
        (1, 4, 0, 12, 3), (2, 4, 0, 12, 3), (3, 4, 0, 12, 3), (4, 2, 1, 12, 6), (5, 2, 1, 12, 6), (6, 2, 1, 12, 6)]
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in ref_steps], rel=LOSS_RTOL)
    assert weights == pytest.approx(ref_weights, rel=LOSS_RTOL, abs=1e-6)

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
from tests.multinode.conftest import free_port
from tests.multinode.test_ssh_restart import LOSS_RTOL, SCRIPT, STEPS, dsrun, records

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
    whole = tmp_path / "whole.jsonl"
    ref = dsrun(["--num_procs", "4", "--master_port", str(free_port()), SCRIPT, str(tmp_path / "whole-ckpt"),
                 str(whole), str(STEPS), "step", "--elastic"])
    assert ref.returncode == 0, ref.stderr[-3000:]

    live, down = tmp_path / "ssh_config", tmp_path / "ssh_config.node-b-down"
    live.write_text(sshd_cluster.ssh_config.read_text())
    node_a = sshd_cluster.write_config(f"{tmp_path.name}-a", {"node-a": "127.0.0.1"})
    node_b = sshd_cluster.write_config(f"{tmp_path.name}-b", {"node-b": "127.0.0.2"}, port=free_port("127.0.0.2"))
    down.write_text(node_a.read_text() + node_b.read_text())
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    cut = tmp_path / "cut.jsonl"
    run = dsrun(["--hostfile", str(hosts), "--ssh_config", str(live), "--max_restarts", "1", SCRIPT,
                 str(tmp_path / "cut-ckpt"), str(cut), str(STEPS), "step", "--elastic", "--die", "3:4",
                 "--down_config", str(down), str(live)])
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "dsrun: dropping host node-b" in log, log[-3000:]
    assert "auto_resume: resumed from step 3" in log and "on 2 rank(s)" in log, log[-3000:]

    steps, weights = records(cut)
    ref_steps, ref_weights = records(whole)
    assert [(r["step"], r["world"], r["restart"], r["batch"], r["gas"]) for r in steps] == [
        (1, 4, 0, 12, 3), (2, 4, 0, 12, 3), (3, 4, 0, 12, 3), (4, 2, 1, 12, 6), (5, 2, 1, 12, 6), (6, 2, 1, 12, 6)]
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in ref_steps], rel=LOSS_RTOL)
    assert weights == pytest.approx(ref_weights, rel=LOSS_RTOL, abs=1e-6)

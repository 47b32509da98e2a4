"""ZeRO++ hpZ over real SSH: the GPT example on 2 loopback nodes x 2 ranks.

The nodes come from the launcher (node-a: ranks 0-1, node-b: ranks 2-3,
LOCAL_WORLD_SIZE 2 each), not from the test. With hpZ the backward
all-gathers stay inside each node, so the inter-node bytes of a step (the
`wall_clock_breakdown` line's "MiB across nodes", comms logger) drop from 3
parts (forward gathers, backward gathers, gradients) to 2, and the fp32
losses do not change at all.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.multinode.test_ssh_launch import dsrun, hostfile

pytestmark = pytest.mark.slow

GPT_ARGS = ["examples/train_gpt.py", "--steps", "3", "--n_layer", "2", "--n_embd", "64", "--n_head", "2",
            "--seq_len", "32", "--log_every", "1", "--eval_batches", "1"]


def _config(tmp_path, hpz: int) -> str:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 1,
           "wall_clock_breakdown": True,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0, "zero_hpz_partition_size": hpz}}
    path = tmp_path / f"hpz{hpz}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_hpz_two_ssh_nodes_same_losses_two_thirds_of_the_inter_node_bytes(sshd_cluster, tmp_path):
    out = {}
    for hpz in (1, 2):
        run = dsrun(["--hostfile", hostfile(tmp_path), "--ssh_config", str(sshd_cluster.ssh_config),
                     GPT_ARGS[0], "--config", _config(tmp_path, hpz), *GPT_ARGS[1:]], timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        text = run.stdout + run.stderr
        losses = re.findall(r"step \d+/\d+ +loss (\S+)", text)
        across = [float(v) for v in re.findall(r"MiB sent \| ([\d.]+) MiB across nodes", text)]
        assert len(losses) == 3 and len(across) == 3, text[-3000:]
        out[hpz] = (losses, across, re.findall(r"validation loss: .*", text))
    assert out[2][0] == out[1][0] and out[2][2] == out[1][2]  # losses to the printed digits
    for plain, hpz in zip(out[1][1][1:], out[2][1][1:]):  # step 1 also counts the validation before training
        # 3 equal parts of 1.5 B plus two 4-byte scalars -> 2 parts (MiB rounded to 0.01)
        assert hpz == pytest.approx(plain * 2 / 3, abs=0.011), (out[1][1], out[2][1])

"""Kubeflow's PyTorchJob / Trainer torch runtime: every pod runs plain `torchrun train.py` with the PET_*
variables (torchrun reads each of its flags from PET_<FLAG>), and the script uses dsrun's DeepSpeed API.
Two torchrun processes, one per "node", meet at 127.0.0.1 as two pods meet at the master pod."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multinode.conftest import expected_losses
from tests.multinode.sshd import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_torchrun_with_kubeflow_pet_variables_trains():
    port = str(free_port())
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
            and not k.startswith(("PET_", "OMPI_", "SLURM_", "SKYPILOT_"))}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                               "tests/multinode/scripts/allreduce_train.py", "--dsrun_init", "--steps", "2"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**base, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(k),
                                   "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port})
             for k in (0, 1)]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=240) + (proc.returncode,))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for node, (out, err, code) in enumerate(outs):
        assert code == 0, f"node {node}:\n{out}\n{err}"
        assert f"WHERE rank={node} local_rank=0" in out
    losses = [float(v) for v in re.findall(r"^LOSS \d+ (\S+)$", outs[0][0], re.M)]
    assert losses == pytest.approx(expected_losses(2), rel=1e-5)

"""Plain `mpirun python train.py`, as Kubeflow's MPI runtime and the MPI Operator start a job: no dsrun launcher,
no MASTER_ADDR, only the hostfile variable the operator sets. Real Open MPI (Debian's openmpi-bin); the two-node
case reaches its second node through the loopback sshd of tests/multinode/conftest.py."""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multinode.conftest import expected_losses
from tests.multinode.sshd import free_port
from tests.system_packages import require_debian_packages

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/multinode/scripts/allreduce_train.py"


def _mpirun(tmp_path, extra_env: dict[str, str], *script_args: str) -> subprocess.CompletedProcess:
    require_debian_packages("openmpi-bin")
    # The ranks see only what mpirun gives them: no MASTER_*/RANK variables of this test process.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(extra_env)
    argv = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:  # Open MPI refuses root unless told; CI runs the suite as root
        argv.append("--allow-run-as-root")
    return subprocess.run([*argv, sys.executable, SCRIPT, *script_args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.slow
def test_plain_mpirun_with_kubeflow_hostfile_trains(tmp_path):
    """Rank 0's address is the first host of OMPI_MCA_orte_default_hostfile (this machine's name, as the
    operator writes pod names); the port is distributed_port. Losses equal the one-process run."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"# written by the MPI operator\n{socket.gethostname()} slots=2\n")
    port = free_port()
    run = _mpirun(tmp_path, {"OMPI_MCA_orte_default_hostfile": str(hostfile)},
                  "--dsrun_init", "--distributed_port", str(port), "--steps", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "(rank 0, over MPI (mpi4py))" in run.stdout or f"MASTER_ADDR={socket.gethostname()} " \
           f"MASTER_PORT={port} (the first host of OMPI_MCA_orte_default_hostfile)" in run.stdout, run.stdout
    losses = [float(v) for v in re.findall(r"^LOSS \d+ (\S+)$", run.stdout, re.M)]
    assert losses == pytest.approx(expected_losses(2), rel=1e-5)
    assert sorted(re.findall(r"WHERE rank=(\d) local_rank=(\d)", run.stdout)) == [("0", "0"), ("1", "1")]


@pytest.mark.slow
def test_plain_mpirun_on_two_ssh_nodes_finds_rank_0_from_the_hostfile(tmp_path, sshd_cluster):
    """Two nodes as the MPI Operator's launcher reaches its workers: mpirun starts rank 1's orted over SSH on
    127.0.0.2 (the loopback sshd), so the ranks are not all on one node and only the hostfile tells rank 1
    where rank 0 is."""
    config = sshd_cluster.write_config(f"mpi_{tmp_path.name}", {"127.0.0.2": "127.0.0.2"})
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    port = free_port()
    run = _mpirun(tmp_path, {"OMPI_MCA_orte_default_hostfile": str(hostfile),
                             "OMPI_MCA_plm_rsh_agent": f"ssh -F {config}"},
                  "--dsrun_init", "--distributed_port", str(port), "--steps", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    mpi4py_used = "(rank 0, over MPI (mpi4py))" in run.stdout
    assert mpi4py_used or f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} (the first host of " \
                          "OMPI_MCA_orte_default_hostfile)" in run.stdout, run.stdout
    # rank 1 came in over SSH on the second node, as the only rank there
    assert re.search(r"WHERE rank=1 local_rank=0 .*via=127\.0\.0\.2", run.stdout), run.stdout
    losses = [float(v) for v in re.findall(r"^LOSS \d+ (\S+)$", run.stdout, re.M)]
    assert losses == pytest.approx(expected_losses(2), rel=1e-5)

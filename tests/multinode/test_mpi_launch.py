"""`dsrun --launcher openmpi` with Debian's real Open MPI: mpirun starts 4 ranks, the shim gives them RANK etc."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multinode.conftest import expected_losses
from tests.system_packages import require_debian_packages

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def openmpi():
    require_debian_packages("openmpi-bin")


def test_openmpi_launch_trains(openmpi, tmp_path):
    """All-reduce sums in another order than the one-process batch mean: 1e-5 relative."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=4\n")
    secret = "mpi-secret-value-42"
    # Open MPI refuses to run as root unless told; CI runs the suite as root.
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", HF_TOKEN=secret)
    run = subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", "--hostfile", str(hosts), "--launcher", "openmpi",
                          "tests/multinode/scripts/allreduce_train.py", "--steps", "2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(v) for v in re.findall(r"^LOSS \d+ (\S+)$", run.stdout, re.M)]
    assert losses == pytest.approx(expected_losses(2), rel=1e-5)
    assert sorted(re.findall(r"WHERE rank=(\d) local_rank=(\d)", run.stdout)) == [(str(i), str(i)) for i in range(4)]
    assert "-x HF_TOKEN" in " ".join(run.stderr.split()) and secret not in run.stdout + run.stderr
    assert "secret_in_cmdline=True" not in run.stdout

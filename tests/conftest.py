"""Shared pytest set-up.

The repository root is put first on sys.path so tests import the working
tree's dsrun even when the package is not installed.

The suite runs on the CPU, on gloo, whatever the machine has: DS_ACCELERATOR
defaults to "cpu" here (the ranks run_ranks starts inherit it), so a test
does not change meaning on a machine with a GPU. A test of the CUDA paths
asks for them with the `cuda` fixture (skipped without a GPU).

Daemons the tests share live here, session-scoped, so a run starts each once
however many directories use it: `sshd_cluster` (tests/multinode/sshd.py),
used by tests/multinode and tests/faults.
"""
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def sshd_cluster(tmp_path_factory):
    """An OpenSSH server on loopback with node-a/node-b aliases (tests/multinode/sshd.py `SshCluster`)."""
    from tests.multinode.sshd import loopback_sshd

    with loopback_sshd(tmp_path_factory.mktemp("sshd")) as cluster:
        yield cluster


@pytest.fixture
def cuda(monkeypatch):
    """The CUDA accelerator for this test (and the ranks it starts); skips without a GPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dsrun.accelerator import real_accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    monkeypatch.setattr(real_accelerator, "_current", None)
    yield torch.device("cuda", 0)
    real_accelerator._current = None

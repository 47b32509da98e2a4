"""Shared pytest set-up.

The repository root is put first on sys.path so tests import the working
tree's dsrun even when the package is not installed.

The suite runs on the CPU, on gloo, whatever the machine has: DS_ACCELERATOR
defaults to "cpu" here (the ranks run_ranks starts inherit it), so a test
does not change meaning on a machine with a GPU. A test of the CUDA paths
asks for them with the `cuda` fixture (skipped without a GPU).

Daemons the tests share live here, session-scoped, so a run starts each once
however many directories use it: `sshd_cluster` (tests/multinode/sshd.py),
used by tests/multinode and tests/faults. Under pytest-xdist a session
fixture is per worker, so `pytest_collection_modifyitems` below puts every
test that uses a shared daemon or launched run in one xdist group.
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


# Tests in one of these directories share session fixtures across files.
_SHARED_GROUPS = {"multinode": "daemons", "examples": "examples"}


def pytest_collection_modifyitems(config, items):
    """Keep the tests that share a fixture on one pytest-xdist worker, longest groups first.

    `make test` runs `-n 2 --dist loadgroup`: an `xdist_group` mark sends every
    test of one group to the same worker. A test's group is its file (module
    fixtures, such as a launched job several assertions read, then run once),
    or a directory whose files share session fixtures (the sshd and Slurm
    daemons of tests/multinode and the launched example runs of
    tests/examples/conftest.py), or "daemons" for any test that uses the sshd
    daemon. Those two directory groups are the longest (minutes), so they go
    first: xdist hands out groups in collection order, and a long group
    started last would run alone at the end. Without xdist the marks change
    nothing and only the order moves.
    """
    def group(item) -> str:
        rel = Path(str(item.path)).relative_to(ROOT / "tests")
        if len(rel.parts) > 1 and rel.parts[0] in _SHARED_GROUPS:
            return _SHARED_GROUPS[rel.parts[0]]
        if "sshd_cluster" in getattr(item, "fixturenames", ()):
            return "daemons"
        return str(rel)

    groups = {item: group(item) for item in items}
    first = list(_SHARED_GROUPS.values())
    items.sort(key=lambda item: first.index(groups[item]) if groups[item] in first else len(first))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item]))

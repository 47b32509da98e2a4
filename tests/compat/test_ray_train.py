"""Ray Train's DeepSpeed pattern (TorchTrainer, `deepspeed.initialize` inside the worker) on dsrun:
examples/ray_train.py with 2 CPU workers against the same steps in one process.

Ray is not in the test extra: `ray[train]` adds about 500 MB (ray, pyarrow, pandas) and its start-up
makes this test take over a minute on 2 cores; it runs where Ray is installed."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray_train.py"


def _losses(out: str) -> list[float]:
    found = re.findall(r"LOSSES (\[[^\]]*\])", out)
    assert found, out
    return json.loads(found[-1])


@pytest.mark.slow
def test_ray_train_torchtrainer_matches_one_process(tmp_path):
    try:
        import ray.train.torch  # noqa: F401
    except ImportError:
        pytest.skip('Ray Train is not installed: pip install "ray[train]" to run this test')
    reference = subprocess.run([sys.executable, str(EXAMPLE), "--reference", "--steps", "3"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    run = subprocess.run([sys.executable, str(EXAMPLE), "--workers", "2", "--steps", "3", "--storage",
                          str(tmp_path / "ray")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ranks=2 LOSSES" in run.stdout  # dsrun adopted Ray's 2-rank group
    assert _losses(run.stdout) == pytest.approx(_losses(reference.stdout), rel=1e-5)

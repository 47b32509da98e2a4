"""DeepSpeedExamples' pipeline-parallel training script, in its shape, runs
under `dsrun` on 4 ranks (pipe=2 x data=2) and learns."""
from __future__ import annotations

import re

import pytest

from tests.compat.test_scripts import SCRIPTS, dsrun

pytestmark = pytest.mark.slow

STEP = re.compile(r"^\[rank 0\] step (\d+) loss (\d+\.\d+)$", re.MULTILINE)


def test_pipeline_script_trains_on_pipe_2_data_2(tmp_path):
    run = dsrun("--num_procs", "4", str(SCRIPTS / "pipeline_train.py"), "--steps", "20", "--deepspeed",
                "--deepspeed_config", str(SCRIPTS / "pipeline_train.json"), cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "pipeline partition (parameters, 2 stages" in run.stdout
    steps = [(int(s), float(loss)) for s, loss in STEP.findall(run.stdout)]
    assert [s for s, _ in steps] == list(range(1, 21)), run.stdout[-3000:]  # printed by rank 0 only
    losses = [loss for _, loss in steps]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.6 * first, losses  # 4 classes: about ln 4 = 1.39 at the start

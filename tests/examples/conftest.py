"""Set-up shared by the example tests: `gpt_run`, train_gpt.py launches started once per session."""
from __future__ import annotations

import pytest

from tests.examples.gpt_runs import GptRuns


@pytest.fixture(scope="session")
def gpt_run(tmp_path_factory) -> GptRuns:
    """`GptRuns` for this session (tests/examples/gpt_runs.py, [Note: one launch per distinct run])."""
    return GptRuns(lambda: tmp_path_factory.mktemp("gpt_run"))

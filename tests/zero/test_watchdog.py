"""A ZeRO-3 hang is reported: rank 1 skips a step (uneven data), rank 0 says
which unit and collective it waits on.

(Ranks that skip a *unit* and keep communicating usually pair collectives of
different sizes, which gloo turns into an immediate abort "collective
mismatch"; the silent case is a rank that stops issuing collectives.)
"""
import datetime
import os
import time

import torch

from tests.dist_helpers import run_ranks
from tests.zero.models import TinyGPT, base_config, batches


def _diverge():
    import dsrun
    from dsrun.runtime import comm

    os.environ["DSRUN_ZERO_WATCHDOG_TIMEOUT"] = "60"  # tightened after the first step (load-proof)
    # Short process-group timeout so the stuck collective fails instead of hanging the test.
    dsrun.init_distributed(timeout=datetime.timedelta(seconds=2))
    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config=base_config(3, stage3_param_persistence_threshold=0))
    error = None
    try:
        for step, (idx, tgt) in enumerate(batches(comm.get_rank(), 2, 2, 1)):
            engine.strategy.watchdog.timeout = 1.0 if step == 1 else 60.0
            if step == 1 and comm.get_rank() == 1:
                time.sleep(3.5)  # rank 1 ran out of data: rank 0 is left waiting
                continue
            engine.backward(engine(idx, tgt))
            engine.step()
    except Exception as exc:  # rank 0: the collective times out
        error = type(exc).__name__
    return engine.strategy.watchdog.reports, error


def test_watchdog_names_unit_and_collective():
    (reports0, error0), (reports1, error1) = run_ranks(_diverge, 2, timeout=120)
    assert error0 is not None and error1 is None
    assert reports0 and reports1 == []
    assert "rank 0 has waited" in reports0[0]
    assert "all-gather of unit '<root>' (forward)" in reports0[0]

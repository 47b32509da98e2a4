"""A ZeRO-3 hang is reported: rank 1 skips a step (uneven data), rank 0 says
which unit and collective it waits on.

(Ranks that skip a *unit* and keep communicating usually pair collectives of
different sizes, which gloo turns into an immediate abort "collective
mismatch"; the silent case is a rank that stops issuing collectives.)
"""
import os
import threading
import time

import torch

from tests.dist_helpers import run_ranks
from tests.zero.models import TinyGPT, base_config, batches


def _signal_when_reported(watchdog, flag: str) -> None:
    """Create `flag` once `watchdog` has reported (polled from a thread: the
    rank's main thread is the one stuck in the collective)."""
    deadline = time.monotonic() + 60
    while not watchdog.reports and time.monotonic() < deadline:
        time.sleep(0.05)
    open(flag, "w").close()


def _diverge(flag: str):
    import dsrun
    from dsrun.runtime import comm

    os.environ["DSRUN_ZERO_WATCHDOG_TIMEOUT"] = "60"  # tightened for the step that diverges
    dsrun.init_distributed()
    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config=base_config(3, stage3_param_persistence_threshold=0))
    watchdog = engine.strategy.watchdog
    error = None
    try:
        for step, (idx, tgt) in enumerate(batches(comm.get_rank(), 2, 2, 1)):
            if step == 1:
                watchdog.timeout = 1.0
                if comm.get_rank() == 0:
                    threading.Thread(target=_signal_when_reported, args=(watchdog, flag), daemon=True).start()
                else:
                    # Rank 1 ran out of data: rank 0 is left waiting. Once rank 0's
                    # watchdog has spoken, rank 1 returns and its process exits,
                    # which fails rank 0's stuck collective (shm or gloo alike).
                    deadline = time.monotonic() + 60
                    while not os.path.exists(flag) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    continue
            engine.backward(engine(idx, tgt))
            engine.step()
    except Exception as exc:  # rank 0: the collective fails when rank 1 exits
        error = type(exc).__name__
    return watchdog.reports, error


def test_watchdog_names_unit_and_collective(tmp_path):
    (reports0, error0), (reports1, error1) = run_ranks(_diverge, 2, str(tmp_path / "rank0_reported"), timeout=120)
    assert error0 is not None and error1 is None
    assert reports0 and reports1 == []
    assert "rank 0 has waited" in reports0[0]
    assert "all-gather of unit '<root>' (forward)" in reports0[0]

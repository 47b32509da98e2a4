"""A hang must not be silent: report what a rank has been waiting on.

ZeRO-3 deadlocks when ranks take different code paths (one rank skips a
unit, DeepSpeed #860/#1888/#5394): each rank then waits in a different
collective until the process-group timeout (30 min by default) with no hint.
Every blocking wait of the stage-3 strategy runs inside
`Watchdog.waiting(what)`; a daemon thread checks once a second and, when one
wait has lasted longer than the timeout, prints (once per wait) which rank
waits on which unit and collective. With every rank reporting, the diverging
rank is the one waiting on a different unit.

The timeout comes from the constructor, else the environment variable
DSRUN_ZERO_WATCHDOG_TIMEOUT (seconds), else 300 s; 0 disables it.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator

from dsrun.env import ZERO_WATCHDOG_TIMEOUT


class Watchdog:
    """Reports waits longer than `timeout` seconds for rank `rank`.

    `reports` keeps the messages printed (for tests and post-mortems).
    Raises ValueError for a negative timeout or a non-numeric variable.
    """

    def __init__(self, rank: int, timeout: float | None = None):
        if timeout is None:
            timeout = ZERO_WATCHDOG_TIMEOUT.read()
        if timeout < 0:
            raise ValueError(f"watchdog timeout must be >= 0 seconds (0 = off), got {timeout}")
        self.rank = rank
        self.timeout = timeout
        self.reports: list[str] = []
        self._current: tuple[str, float] | None = None
        self._reported = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Mark the enclosed block as a wait on `what` (e.g. "all-gather of unit 'h.3' (forward)")."""
        if self.timeout == 0 or self._stop.is_set():
            yield
            return
        self._start()
        with self._lock:
            self._current, self._reported = (what, time.monotonic()), False
        try:
            yield
        finally:
            with self._lock:
                self._current = None

    def close(self) -> None:
        """Stop the watching thread (waits for it: at most one period); later
        waits are not watched. Calling it again does nothing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="dsrun-zero-watchdog", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            with self._lock:
                if self._current is None or self._reported:
                    continue
                what, since = self._current
                waited = time.monotonic() - since
                if waited < self.timeout:
                    continue
                self._reported = True
            msg = (f"[dsrun zero watchdog] rank {self.rank} has waited {waited:.1f}s on {what}; "
                   "if other ranks report a different unit or collective, the ranks took different "
                   "code paths (every rank must run the same modules in the same order under ZeRO-3)")
            self.reports.append(msg)
            print(msg, file=sys.stderr, flush=True)

"""A communication thread: runs synchronous collectives while the caller computes.

The shared-memory collectives (dsrun.ops.shm_comm) return only when their
result is in place. `CommThread` runs them on one background thread per
process, in the order they were submitted, so the caller's thread goes on
(with backward, for stage 0's gradient buckets); see [Note: overlap on a
communication thread] in collectives.py for when that pays.

The native call goes through ctypes.CDLL, which releases the GIL for its
duration, and autograd releases it around every kernel, so the two threads
really run at once; only the few Python lines around each call hold it.

Rules that keep every rank's collective sequence identical:
- one thread, one FIFO queue: work runs in submission order;
- a caller that issues a collective on the same transport itself first
  calls `drain()`, which waits until the queue is empty, so the thread's
  work and the caller's never interleave differently on different ranks
  (and never touch the ShmGroup at the same time).
An error in the thread is re-raised by the failed work's `wait()` and by
every later `wait()` or `drain()` (the later collectives are not run: the
ranks' sequences no longer match). The thread is a daemon that `close()`
(registered with atexit) stops and joins, so no native call is in flight
while the interpreter tears down the group it runs on.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
from typing import Callable

import torch.distributed as dist

_STOP = object()


class CommError(RuntimeError):
    """A collective run on the communication thread failed (the cause is chained)."""


class ThreadWork(dist.Work):
    """Handle of one collective submitted to a CommThread: `wait()` blocks
    until it ran and raises CommError if it (or an earlier one) failed."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout=None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise CommError(f"{self.name} on the communication thread failed: {self._error}") from self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None


class CommThread:
    """One daemon thread running submitted callables in order (see the module docstring)."""

    def __init__(self, name: str = "dsrun-comm") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._last: ThreadWork | None = None  # the latest submitted work: drain() waits for it
        self._error: BaseException | None = None  # first failure; poisons everything after it
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, name: str, fn: Callable[[], None]) -> ThreadWork:
        """Queue `fn` (a collective, run on the thread); returns its handle."""
        if not self._thread.is_alive():
            raise CommError(f"{name}: the communication thread has stopped")
        work = ThreadWork(name)
        self._last = work
        self._queue.put((work, fn))
        return work

    def drain(self) -> None:
        """Wait until every submitted collective has run; raise CommError if one failed."""
        if self._last is not None:
            self._last.wait()

    def close(self) -> None:
        """Let queued work finish, then stop and join the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            work, fn = item
            if self._error is not None:
                work._finish(CommError(f"not run: an earlier collective failed ({self._error})"))
                continue
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread
                self._error = e
                work._finish(e)
            else:
                work._finish(None)
            # Drop the tensors fn captured now, not when the next item arrives:
            # a transient buffer (ZeRO's gradient staging) must be freeable once waited on.
            del item, work, fn


class _Process:
    """This process's CommThread, started on first use."""

    thread: CommThread | None = None
    pid: int | None = None


def get() -> CommThread:
    """This process's communication thread (started on first use; a forked
    child gets its own, the parent's thread does not exist there)."""
    if _Process.thread is None or _Process.pid != os.getpid():
        _Process.thread, _Process.pid = CommThread(), os.getpid()
    return _Process.thread


def drain() -> None:
    """Wait for this process's communication thread to be idle (no-op if never started)."""
    if _Process.thread is not None and _Process.pid == os.getpid():
        _Process.thread.drain()


def shutdown() -> None:
    """Stop this process's communication thread after its queued work (at exit)."""
    if _Process.thread is not None and _Process.pid == os.getpid():
        _Process.thread.close()
    _Process.thread = None


atexit.register(shutdown)

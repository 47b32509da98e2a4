"""How a rank ends on a config error: one clean message, a distinct exit code.

A ConfigError is the user's input, not a bug, so its traceback says nothing
the message does not. `install()` (called by `initialize`) wraps
`sys.excepthook`: an uncaught ConfigError is printed as "dsrun: <message>"
on stderr, without traceback, and the process exits with
`CONFIG_ERROR_EXIT_CODE`, which the launcher's failure summary names. Other
exceptions go to the previous hook unchanged.

[Note: one message per job]
When every rank has the same problem (see dsrun/runtime/distributed/agreement.py),
ranks other than 0 carry `shown_by_rank = 0` and print nothing, and rank
0's error carries `quiet_ranks`, how many they are. Through the rendezvous
store (which rank 0 usually hosts) rank 0 says it has printed, each quiet
rank acknowledges, rank 0 exits once all did (at most `_WAIT_S`), and the
quiet ranks exit a moment later: rank 0 goes first, so the launcher's
summary shows its message rather than a silent rank, and no rank is left
talking to a store that is gone.
This module imports no torch at module level: the launcher reads the code.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

CONFIG_ERROR_EXIT_CODE = 78  # EX_CONFIG in sysexits.h: "configuration error"
_SHOWN_KEY = "dsrun/config_error_shown"
_ACK_KEY = "dsrun/config_error_acks"
_WAIT_S = 10.0
_AFTER_S = 1.0

# The hooks `install` replaced, oldest first. torch's init_process_group
# wraps whatever hook is current, so after a second process group the chain
# can lead back here: each re-entry goes one hook further down the list.
_previous_hooks: list = []
_depth = 0


def _store():
    """The default process group's rendezvous store, or None."""
    try:
        import torch.distributed as dist
        if not dist.is_initialized():
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a missing store only loses the ordering
        return None


def _hook(exc_type, value, tb) -> None:
    global _depth
    from dsrun.runtime.config import ConfigError
    if not isinstance(value, ConfigError) or _depth:
        previous = (_previous_hooks[-1 - _depth] if _depth < len(_previous_hooks)
                    else sys.__excepthook__)
        _depth += 1
        try:
            previous(exc_type, value, tb)
        finally:
            _depth -= 1
        return
    shown_by = getattr(value, "shown_by_rank", None)
    store = _store()
    if shown_by is None:
        sys.stderr.write(f"dsrun: {value}\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        quiet = getattr(value, "quiet_ranks", 0)
        if store is not None and quiet:
            store.set(_SHOWN_KEY, "1")
            deadline = time.monotonic() + _WAIT_S
            while store.add(_ACK_KEY, 0) < quiet and time.monotonic() < deadline:
                time.sleep(0.02)
        elif store is not None and shown_by is not None:
            store.wait([_SHOWN_KEY], datetime.timedelta(seconds=_WAIT_S))
            store.add(_ACK_KEY, 1)
            time.sleep(_AFTER_S)
    except Exception:  # noqa: BLE001 - rank 0 gone or never printing: exit anyway
        pass
    # os._exit: no atexit handlers, so the process group is not torn down
    # after an error (see dsrun.runtime.distributed.dist._leave), and the code is ours.
    os._exit(CONFIG_ERROR_EXIT_CODE)


def install() -> None:
    """Route uncaught ConfigErrors through `_hook` (idempotent). Call it
    after the process group exists, so that torch's own hook (which
    buffers stderr to prefix it with the rank) does not swallow the message."""
    if sys.excepthook is not _hook:
        _previous_hooks.append(sys.excepthook)
        sys.excepthook = _hook

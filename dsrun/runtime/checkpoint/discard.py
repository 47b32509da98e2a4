"""Deleting old checkpoint files without making a save wait for it.

[Note: deletion off the save's path]
Unlinking a large file is not free: the file system releases every block
before unlink(2) returns, and on a file system mounted with `discard` (ext4
on this development machine's virtual disk) it also tells the device,
synchronously. Removing one 288 MB shard takes 60-70 ms here (20 ms of it
CPU). A save that overwrites a tag (os.replace onto the old shard unlinks
it) or prunes the oldest tag for `checkpoint.keep_last` (rank 0 removes
every rank's shard) used to pay that inside the call: pruning one 575 MB
checkpoint of the 48M GPT added 0.04-0.12 s (13-50%) to a 0.2-0.3 s save
(bench/checkpoint/README.md).

So old files are first moved aside, which is a rename within the same
directory tree (atomic, microseconds): into a fresh hidden directory
`<save_dir>/.dsrun-deleting-<random>` (store.TRASH_PREFIX), and a
background thread deletes that directory while training goes on. What a
crash leaves is what an interrupted delete left before: the pruned tag had
its index removed first, so it was already incomplete, and its files now
sit under a hidden name that no load, `latest` lookup or `dsrun-ckpt
inspect` treats as a tag; the next save that discards anything in the same
save_dir deletes such leftovers too. The threads are not daemons: the
interpreter waits for them at exit, so a finished job leaves no garbage.
A path that cannot be renamed there (on another file system mounted inside
save_dir) is deleted in place, in the call, as before.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import threading

from dsrun.runtime.checkpoint.store import TRASH_PREFIX

log = logging.getLogger("dsrun.checkpoint")

_threads: list[threading.Thread] = []
_busy: set[str] = set()  # hidden directories this process's threads are deleting
_lock = threading.Lock()


def discard(save_dir: str, paths: list[str]) -> None:
    """Move `paths` (files or directories on save_dir's file system) into a
    new hidden directory under `save_dir` and delete it, and any such
    directory a crashed run left there, in a background thread.

    Raises OSError when a path can be neither moved nor deleted (a missing
    one, permissions); the paths moved before it are deleted all the same.
    """
    trash = tempfile.mkdtemp(prefix=TRASH_PREFIX, dir=save_dir)
    try:
        for i, path in enumerate(paths):
            try:
                os.rename(path, os.path.join(trash, f"{i}-{os.path.basename(os.path.normpath(path))}"))
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EBUSY):  # not on save_dir's file system: delete it here
                    raise
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
    finally:
        with _lock:
            dirs = [trash] + [os.path.join(save_dir, d) for d in os.listdir(save_dir)
                              if d.startswith(TRASH_PREFIX) and os.path.join(save_dir, d) not in _busy | {trash}]
            _busy.update(dirs)
            _threads[:] = [t for t in _threads if t.is_alive()]
            _threads.append(threading.Thread(target=_delete, args=(dirs,), name="dsrun-ckpt-delete"))
            _threads[-1].start()


def _delete(dirs: list[str]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)  # another run may delete a leftover at the same time
        if os.path.exists(d):
            log.warning("could not delete %s; remove it by hand", d)
        with _lock:
            _busy.discard(d)


def wait() -> None:
    """Block until every deletion this process started has finished."""
    for thread in list(_threads):
        thread.join()
    _threads.clear()

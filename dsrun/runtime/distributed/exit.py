"""A rank's last exit step: flush its open files, then hide every live object from the cyclic
garbage collector (`gc.freeze`), so that interpreter teardown does not walk them again.

[Note: a cheap exit]
Python's exit with torch loaded costs about 0.5 CPU-s per process: `python -c
"import torch"` takes 1.51-1.65 CPU-s, 0.96-1.07 when it ends with os._exit(0)
and 1.06-1.18 when it ends with gc.freeze() (2-core Xeon, torch 2.13): most
of the exit is the cyclic garbage collector examining torch's objects
(about 170,000 with gc.get_objects()) while the interpreter finalizes,
which it skips for frozen objects. A 2-rank gloo job's rank (torch,
init_distributed, one all-reduce) took 2.11 CPU-s before this step and
1.71 with it, against 1.45 when it ends with os._exit(0)
(bench/launcher/rank_exit.py); a node's whole launcher work is 0.3-0.45
CPU-s (bench/launcher/README.md). So this step is run by every rank that
called `init_distributed`, as the last thing of dsrun's exit handler
(`dist._leave`) on a clean exit. A failing rank already ends with
os._exit(1) there.

What is kept, and why:
- Every exit handler runs. Handlers registered after `init_distributed` run
  before this one (atexit runs the last registered first), the others after
  it; gc.freeze stops no code, it only moves the objects alive now into a
  generation the collector never examines. Non-daemon threads (the
  asynchronous checkpoint writer, checkpoint deletion) were joined before
  any exit handler; weakref.finalize callbacks (swap directories) run from
  their own exit handler; logging.shutdown flushes and closes every
  logging handler itself; sys.stdout and sys.stderr are flushed by Python
  after all of this.
- Objects freed by reference counting are freed exactly as before: when
  the modules are cleared, an object that is not part of a reference cycle
  is deallocated and finalized (a file is flushed and closed), frozen or not.
- What changes: an object alive now that later becomes garbage only as part
  of a reference cycle (say a file held by an object that refers back to
  itself, reachable only from a module global) is never collected, so its
  finalizer (`__del__`, `close`) does not run. Python does not promise that
  finalizers of objects alive at exit run at all, but buffered file data
  is what a user would lose. So before freezing, every open file object
  backed by a regular file is flushed: its bytes reach the file even if the
  object is never closed; the kernel closes the descriptor when the process
  ends. Pipes and sockets are left alone (a flush could block on a reader
  that is gone; stdout and stderr are flushed by Python). What a flush
  cannot do is what only `close` does: a gzip or zip file's trailer, a
  NamedTemporaryFile's deletion. Such an object, in a cycle and never
  closed, is left unfinished; close it (a `with` block) -- or, to have the
  old exit, register an exit handler before `init_distributed` that calls
  gc.unfreeze() and gc.collect() (it runs after this step).
tests/faults/test_runtime_clean_exit.py checks a rank's output and files
(in a cycle too) after exit.
"""
from __future__ import annotations

import _io
import gc
import io
import os
import stat


def freeze_for_exit() -> None:
    """Flush every open, writable file object of this process that writes a regular file, then
    gc.freeze(); see [Note: a cheap exit]. Call it last, after the final gc.collect()."""
    objects = gc.get_objects()
    # By type, not isinstance per object: torch holds ~10^5 objects, and isinstance may read
    # obj.__class__, which some objects compute (a deprecated torch alias warns then). Against io's C
    # base class, which every file object type derives from: io.IOBase is an ABC, and each negative
    # ABC check walks all its registered subclasses (0.1 CPU-s for torch's ~500 types).
    files = {kind for kind in set(map(type, objects)) if issubclass(kind, _io._IOBase)}
    for obj in objects:
        if type(obj) in files:
            _flush_regular_file(obj)
    del objects
    gc.freeze()


def _flush_regular_file(f: io.IOBase) -> None:
    try:
        if f.closed or not f.writable() or not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return
        f.flush()
    except (OSError, ValueError):  # no descriptor (an in-memory file), closed underneath, disk full: nothing to save
        pass

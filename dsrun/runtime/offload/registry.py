"""Which swap directories the ranks of a job on this node own, for the launcher's agent.

A rank that creates a swap directory writes its path into
`<tmp>/dsrun-<uid>/swap/<DSRUN_JOB_ID>/<unique name>` and deletes that
entry when it removes the directory itself. A rank killed by a signal
leaves its entry; the per-node agent (dsrun/launcher/agent.py) calls
`remove_registered(job_id)` after all its ranks exited, which deletes every
registered directory and the registry. Outside the dsrun launcher (no
DSRUN_JOB_ID) nothing is registered. No torch import: the agent uses it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dsrun.env import JOB_ID


def registry_dir(job_id: str) -> Path:
    """The per-job registry directory on this node."""
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in job_id)
    return Path(tempfile.gettempdir()) / f"dsrun-{os.getuid()}" / "swap" / safe


def _entry(path: Path) -> Path | None:
    job = JOB_ID.read()
    if not job:
        return None
    import hashlib  # here, not at the top: only ranks hash, and the agent imports this module on every node

    return registry_dir(job) / hashlib.sha1(str(path).encode()).hexdigest()


def register(path: Path) -> None:
    """Record that this job owns swap directory `path` (when run by the dsrun launcher)."""
    entry = _entry(path)
    if entry is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_text(str(path))


def unregister(path: Path) -> None:
    """The directory was removed by its rank: forget it."""
    entry = _entry(path)
    if entry is not None:
        entry.unlink(missing_ok=True)
        try:
            entry.parent.rmdir()  # the last of the job's directories on this node
        except OSError:
            pass


def remove_registered(job_id: str) -> list[str]:
    """Delete every swap directory registered for `job_id` on this node (and
    its parent `dsrun-<job>` directory when empty), then the registry.
    Returns the directories removed. Only directories named rank<N> under a
    dsrun-<job> directory are touched."""
    reg = registry_dir(job_id)
    removed = []
    if not reg.is_dir():
        return removed
    for entry in reg.iterdir():
        path = Path(entry.read_text().strip())
        if path.name.startswith("rank") and path.parent.name.startswith("dsrun-") and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
            try:
                path.parent.rmdir()
            except OSError:
                pass
        entry.unlink(missing_ok=True)
    shutil.rmtree(reg, ignore_errors=True)
    return removed

"""Install Debian packages a test needs (sshd, Slurm, liburing, fio, ...).

Tests that exercise real servers or native libraries call
`ensure_debian_packages` from a fixture. Missing packages are installed with
apt-get (the CI machine runs as root with Debian's mirror reachable); a
failure raises with apt's output so the test fails with the reason instead
of being skipped.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

_LOCK = Path("/tmp/dsrun-tests-apt.lock")
_updated = False


def _installed(package: str) -> bool:
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package],
        capture_output=True, text=True,
    )
    return out.returncode == 0 and "install ok installed" in out.stdout


def ensure_debian_packages(*packages: str, timeout: float = 900.0) -> None:
    """Make sure each Debian package in `packages` is installed.

    Raises:
        RuntimeError: not root, no apt-get, or apt-get failed (its output is
            in the message).
    """
    global _updated
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several pytest processes may ask at once
        missing = [p for p in packages if not _installed(p)]
        if not missing:
            return
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise RuntimeError(
                f"Debian packages {missing} are needed and cannot be installed "
                "(needs root and apt-get); install them by hand."
            )
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        steps = [] if _updated else [["apt-get", "update", "-q"]]
        steps.append(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing])
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        _updated = True

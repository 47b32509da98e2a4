"""The Debian packages the test suite needs, installed before the first test.

`make test` runs `python3 tests/system_packages.py` (its `system-packages`
step) before pytest: as root it runs apt-get update and installs whatever in
SUITE_PACKAGES is missing; already installed, it does nothing and needs no
root. Tests only check, through `require_debian_packages` from a fixture,
and fail with a message naming that step. No test installs anything: a
package arriving halfway through a run comes after earlier tests (and the
process's memory of an op that failed to build) have already seen it missing.

The native ops need no package here: they build with gcc and the kernel's
headers (linux-libc-dev), which come with the compiler.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

# Package -> what needs it.
SUITE_PACKAGES = {
    "openssh-server": "tests/multinode/sshd.py: a loopback sshd for the pdsh/ssh launchers",
    "openssh-client": "tests/multinode/sshd.py: ssh and ssh-keygen",
    "slurm-wlm": "tests/multinode/conftest.py: a two-node Slurm cluster on this machine",
    "munge": "tests/multinode/conftest.py: Slurm's authentication",
    "iproute2": "tests/multinode/netns_link.py: network namespaces, veth pairs and tc",
    "openmpi-bin": "tests/multinode/test_mpi_launch.py: mpirun",
    "fio": "bench/ops/bench_aio.py: the baseline of the aio benchmark",
}
INSTALL_STEP = "`make system-packages` (run by `make test` before pytest, as root)"


def missing_packages(packages) -> list[str]:
    """Those of `packages` that dpkg does not report as installed (all of them without dpkg)."""
    if shutil.which("dpkg-query") is None:
        return list(packages)
    missing = []
    for p in packages:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True, check=False)
        if out.returncode != 0 or "install ok installed" not in out.stdout:
            missing.append(p)
    return missing


def require_debian_packages(*packages: str) -> None:
    """Check that each Debian package in `packages` is installed; install nothing.

    Raises:
        ValueError: a package not in SUITE_PACKAGES (the install step would
            never bring it: add it there).
        RuntimeError: some are missing; the message names them and the install step.
    """
    unknown = [p for p in packages if p not in SUITE_PACKAGES]
    if unknown:
        raise ValueError(f"{unknown} are not in tests/system_packages.py SUITE_PACKAGES; add them there so that "
                         f"{INSTALL_STEP} installs them")
    missing = missing_packages(packages)
    if missing:
        raise RuntimeError(f"Debian packages {missing} are not installed. {INSTALL_STEP} installs every package "
                           "the suite needs before the first test; tests never install packages themselves.")


def install_missing() -> int:
    """Install the missing SUITE_PACKAGES with apt-get (update first); return an exit status."""
    missing = missing_packages(SUITE_PACKAGES)
    if not missing:
        print(f"system packages: all {len(SUITE_PACKAGES)} present")
        return 0
    if shutil.which("apt-get") is None or shutil.which("dpkg-query") is None:
        print(f"system packages: {missing} are needed, and this is no Debian/Ubuntu system (no apt-get/dpkg); "
              "install their equivalents by hand", file=sys.stderr)
        return 1
    if os.geteuid() != 0:
        print(f"system packages: {missing} are needed and installing them needs root: "
              "sudo make system-packages", file=sys.stderr)
        return 1
    print(f"system packages: installing {' '.join(missing)}", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lock_wait = "DPkg::Lock::Timeout=600"  # wait for another apt run rather than fail at once
    for cmd in (["apt-get", "-o", lock_wait, "update", "-q"],
                ["apt-get", "-o", lock_wait, "install", "-y", "-q", "--no-install-recommends", *missing]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"system packages: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                  f"{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
    still = missing_packages(missing)
    if still:
        print(f"system packages: apt-get succeeded but {still} are still not installed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(install_missing())

"""The suite's Debian packages are installed before the first test, never by a test."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import system_packages

ROOT = Path(__file__).resolve().parents[1]


def test_make_test_installs_packages_before_pytest():
    for target in ("test", "test-quick"):
        steps = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True,
                               check=True).stdout.splitlines()
        install = next(i for i, s in enumerate(steps) if "tests/system_packages.py" in s)
        pytest_step = next(i for i, s in enumerate(steps) if "-m pytest" in s)
        assert install < pytest_step, steps


def test_no_test_installs_packages_itself():
    allowed = {"system_packages.py", Path(__file__).name}  # the install step, and this test's own text
    installers = [p.relative_to(ROOT) for p in (ROOT / "tests").rglob("*.py")
                  if p.name not in allowed and "apt-get" in p.read_text()]
    assert not installers, f"{installers} run apt-get; list the package in tests/system_packages.py instead"


def test_require_checks_only_and_names_the_install_step(monkeypatch):
    with pytest.raises(ValueError, match="not in tests/system_packages.py SUITE_PACKAGES"):
        system_packages.require_debian_packages("libfoo-dev")
    monkeypatch.setattr(system_packages, "missing_packages", lambda packages: ["munge"])
    with pytest.raises(RuntimeError, match=r"\['munge'\] are not installed. `make system-packages`"):
        system_packages.require_debian_packages("slurm-wlm", "munge")


def test_install_step_without_root_says_how(monkeypatch, capsys):
    monkeypatch.setattr(system_packages, "missing_packages", lambda packages: ["fio"])
    monkeypatch.setattr(system_packages.os, "geteuid", lambda: 1000)
    assert system_packages.install_missing() == 1
    assert "sudo make system-packages" in capsys.readouterr().err
    monkeypatch.setattr(system_packages, "missing_packages", lambda packages: [])
    assert system_packages.install_missing() == 0

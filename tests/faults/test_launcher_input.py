"""Hostile or careless input to the launcher (issue 11, items 6, 7, 13 and 14).

Each case is one probe of the issue: a secret on dsrun's command line, a
newline in a dsrun-sbatch value, host and slot counts that exhausted memory,
and arguments that gave a traceback or a wrong message.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsrun.launcher.hostfile import HostfileError, parse_hostfile_text, select_slots
from dsrun.launcher.propagate import EnvFileError, propagated_env

ROOT = Path(__file__).resolve().parents[2]


def dsrun(cwd: Path, *args: str, env: dict[str, str] | None = None, module: str = "dsrun.launcher.cli",
          timeout: float = 60) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=environ, capture_output=True,
                           text=True, timeout=timeout)


def flat(text: str) -> str:
    """Text with rich's box characters and line wrapping removed."""
    return " ".join(text.replace("│", " ").split())


# ---- item 6: secrets by name ------------------------------------------------------------------


def test_env_name_forwards_the_value_without_putting_it_in_argv(tmp_path):
    secret = "wandb-s3cret-0123456789"
    (tmp_path / "show.py").write_text(
        "import os\n"
        "print('KEY', os.environ['WANDB_API_KEY'] == 'wandb-s3cret-0123456789')\n")
    run = dsrun(tmp_path, "--num_procs", "1", "--env", "WANDB_API_KEY", "--print_env", "show.py",
                env={"WANDB_API_KEY": secret})
    assert run.returncode == 0, run.stderr
    assert "[rank 0] KEY True" in run.stdout
    assert secret not in run.stderr and "WANDB_API_KEY=<23 chars>" in flat(run.stderr)


def test_env_name_that_is_not_set_is_an_error(tmp_path):
    with pytest.raises(EnvFileError, match="--env NOPE_TOKEN: NOPE_TOKEN is not set"):
        propagated_env({}, tmp_path, ["NOPE_TOKEN"], home=tmp_path)
    assert propagated_env({"TOKEN": "v"}, tmp_path, ["TOKEN"], home=tmp_path) == {"TOKEN": "v"}


def test_help_recommends_env_name_for_secrets(tmp_path):
    out = flat(dsrun(tmp_path, "--help").stdout)
    assert "Use NAME for secrets" in out and "visible to every local user in ps" in out


# ---- item 7: dsrun-sbatch writes nothing unquoted ------------------------------------------------


def test_sbatch_rejects_a_newline_in_any_value(tmp_path):
    (tmp_path / "train.py").write_text("")
    for option in ("--partition", "--output", "--time", "--dsrun-arg"):
        run = dsrun(tmp_path, "--nodes", "1", option, "gpu\ntouch INJECTED", "train.py",
                    module="dsrun.launcher.sbatch")
        assert run.returncode == 2, (option, run.stderr)
        assert "contains a newline" in run.stderr or "not a Slurm time" in run.stderr, run.stderr
        assert not (tmp_path / "dsrun.sbatch").exists()
    run = dsrun(tmp_path, "--nodes", "1", "train.py", "--tag", "a\nb", module="dsrun.launcher.sbatch")
    assert run.returncode == 2 and "contains a newline" in run.stderr


def test_sbatch_quotes_directive_values(tmp_path):
    (tmp_path / "train.py").write_text("")
    run = dsrun(tmp_path, "--nodes", "1", "--output", "logs/%j #1.out", "--partition", "a b;touch X",
                "train.py", module="dsrun.launcher.sbatch")
    assert run.returncode == 0, run.stderr
    text = (tmp_path / "dsrun.sbatch").read_text()
    assert "#SBATCH '--output=logs/%j #1.out'\n" in text and "#SBATCH '--partition=a b;touch X'\n" in text
    # bash runs the script's own lines only: nothing from a value becomes a command.
    check = subprocess.run(["bash", "-n", str(tmp_path / "dsrun.sbatch")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


# ---- item 13: bounded sizes ---------------------------------------------------------------------


@pytest.mark.parametrize("text, words", [
    ("node[0-9999999] slots=1\n", "'node[0-9999999]' names more than 65536 hosts"),
    ("r[0-999]n[0-999] slots=1\n", "names more than 65536 hosts"),
    ("h slots=99999999999999999999\n", "slots=99999999999999999999 is more than 4096 ranks on one host"),
    ("h slots=" + "9" * 5000 + "\n", "is more than 4096 ranks on one host"),
    ("node[1-" + "9" * 5000 + "] slots=1\n", "has a bound above 10^12"),
])
def test_hostfile_sizes_are_bounded_before_expanding(text, words):
    start = time.monotonic()
    with pytest.raises(HostfileError, match=None) as e:
        parse_hostfile_text(text, "hosts")
    assert words in str(e.value) and time.monotonic() - start < 1


def test_filter_slot_ranges_are_checked_against_the_slot_count_before_expanding():
    hosts = parse_hostfile_text("host slots=2\n")
    start = time.monotonic()
    with pytest.raises(HostfileError, match="slot 99999999999 is beyond host 'host', which has slots 0-1"):
        select_slots(hosts, include="host:0-99999999999")
    with pytest.raises(HostfileError, match="names more than 65536 hosts"):
        select_slots(hosts, exclude="node[0-99999999]")
    assert time.monotonic() - start < 1


def test_huge_slots_in_a_hostfile_is_a_message_not_a_traceback(tmp_path):
    (tmp_path / "hosts").write_text("h slots=99999999999999999999\n")
    (tmp_path / "train.py").write_text("")
    run = dsrun(tmp_path, "--hostfile", "hosts", "--dry_run", "train.py")
    assert run.returncode == 2 and "Traceback" not in run.stderr and "OverflowError" not in run.stderr
    assert "hosts:1:9: slots=99999999999999999999 is more than 4096" in flat(run.stderr)


# ---- item 14: precise messages ------------------------------------------------------------------


def test_script_that_is_a_directory(tmp_path):
    (tmp_path / "pkg").mkdir()
    run = dsrun(tmp_path, "pkg")
    assert run.returncode == 2 and "'pkg' is a directory" in flat(run.stderr), run.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_grace_period_is_a_click_error(tmp_path, value):
    (tmp_path / "train.py").write_text("")
    run = dsrun(tmp_path, "--grace_period", value, "train.py")
    assert run.returncode == 2 and "Traceback" not in run.stderr and "validation error" not in run.stderr
    assert "--grace_period" in run.stderr and ("not a number of seconds" in run.stderr or "range" in run.stderr)


def test_host_names_differing_in_case_are_one_host(tmp_path):
    with pytest.raises(HostfileError, match="host 'worker-0' is listed twice .first on line 1 as 'Worker-0'; "
                                            "host names are case-insensitive"):
        parse_hostfile_text("Worker-0 slots=1\nworker-0 slots=1\n", "hosts")
    hosts = parse_hostfile_text("Worker-0 slots=2\nworker-1 slots=2\n", "hosts")
    assert select_slots(hosts, include="WORKER-0:1") == {"Worker-0": [1]}


def test_more_ranks_than_cores_without_gpus_warns(tmp_path):
    (tmp_path / "train.py").write_text("")
    cores = len(os.sched_getaffinity(0))
    run = dsrun(tmp_path, "--num_procs", str(cores + 1), "--dry_run", "train.py", env={"CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr
    assert f"warning: {cores + 1} ranks on a machine with {cores} CPU core(s) and no GPU" in flat(run.stderr)
    run = dsrun(tmp_path, "--num_procs", "5000", "--dry_run", "train.py")
    assert run.returncode == 2 and "more than dsrun's limit of 4096" in flat(run.stderr)

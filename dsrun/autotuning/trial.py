"""One trial: a real dsrun launch of the user's script with a candidate's config, and its outcome.

The trial runs the same `dsrun` command line the user gave (hosts, ranks,
launcher: one node or many, through the same code path), with two changes:
the script's config argument points at the trial's config file in
`exps_dir/<trial>/ds_config.json` (as DeepSpeed's autotuner rewrites it),
and `--env DSRUN_AUTOTUNING_RESULT=<exps_dir/<trial>/result.json>` tells the
engine where to write what it measured (see [Note: autotuning trials] in
dsrun/runtime/engine/autotuning_probe.py). `arg_mappings` hands the trial's
batch settings to scripts that also take them as arguments. The trial's
output goes to stdout.log and stderr.log beside its config; exps_dir must be
on a file system that every node sees (as the script itself must be).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsrun.autotuning.results import (
    ResultError,
    TrialResult,
    failure_reason,
    read_result,
)
from dsrun.autotuning.space import AC_KEY
from dsrun.env import AUTOTUNING_RESULT

# The script arguments that name the config, in the order they are looked for
# (--deepspeed takes a path in Hugging Face's scripts; elsewhere it is a flag).
CONFIG_FLAGS = ("--deepspeed_config", "--config", "--deepscale_config", "--deepspeed")
_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


@dataclass(frozen=True)
class Job:
    """The user's command, split: dsrun's own options (without --autotuning), the script and its args."""

    launcher_args: tuple[str, ...]
    script: str
    script_args: tuple[str, ...]

    @classmethod
    def from_argv(cls, argv: list[str], script: str, script_args: tuple[str, ...]) -> Job:
        """Split dsrun's command line `argv` (without the program name) as click parsed it:
        everything before the script is dsrun's, less ``--autotuning MODE`` / ``--autotuning=MODE``."""
        own = list(argv[:len(argv) - 1 - len(script_args)])
        launcher: list[str] = []
        skip = False
        for arg in own:
            if skip:
                skip = False
            elif arg == "--autotuning":
                skip = True
            elif not arg.startswith("--autotuning="):
                launcher.append(arg)
        return cls(tuple(launcher), script, tuple(script_args))


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended: status "ok" with its `result`, or "failed" with a one-line `reason`."""

    status: str
    result: TrialResult | None
    reason: str
    seconds: float


def find_config_arg(script_args: tuple[str, ...] | list[str]) -> tuple[int, str]:
    """(index of the value, path) of the script's config argument.

    Recognises ``--flag PATH`` and ``--flag=PATH`` for the flags in CONFIG_FLAGS
    (``--deepspeed`` only with a .json/.yaml/.yml value).

    Raises:
        ValueError: no config argument among the script's arguments.
    """
    for flag in CONFIG_FLAGS:
        for i, arg in enumerate(script_args):
            if arg.startswith(flag + "="):
                value = arg[len(flag) + 1:]
                if flag != "--deepspeed" or value.endswith(_CONFIG_SUFFIXES):
                    return i, value
            elif arg == flag and i + 1 < len(script_args):
                value = script_args[i + 1]
                if flag != "--deepspeed" or value.endswith(_CONFIG_SUFFIXES):
                    return i + 1, value
    raise ValueError("dsrun --autotuning needs the script's ds_config among its arguments (one of "
                     f"{', '.join(CONFIG_FLAGS)}), to give each trial its own config; none was found in "
                     f"{' '.join(script_args) or '(no arguments)'}")


def script_args_for(script_args: tuple[str, ...], config_path: Path, config: dict[str, Any],
                    arg_mappings: dict[str, str] | None, activation_checkpointing: bool | None) -> list[str]:
    """The script's arguments for a run with `config` at `config_path`.

    The config argument is replaced; each `arg_mappings` entry (config key ->
    script flag) gets the config's value, replacing the flag's value when the
    flag is given and appending ``FLAG VALUE`` when not; the
    activation_checkpointing entry gets true or false (`activation_checkpointing`,
    None: left alone).
    """
    args = list(script_args)
    index, _ = find_config_arg(args)
    args[index] = args[index].split("=", 1)[0] + "=" + str(config_path) if args[index].startswith("--") \
        else str(config_path)
    for key, flag in (arg_mappings or {}).items():
        if key == AC_KEY:
            if activation_checkpointing is None:
                continue
            value = "true" if activation_checkpointing else "false"
        elif key in config:
            value = str(config[key])
        else:
            continue
        args = _set_flag(args, flag, value)
    return args


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return [*args[:i], f"{flag}={value}", *args[i + 1:]]
        if arg == flag and i + 1 < len(args):
            return [*args[:i + 1], value, *args[i + 2:]]
    return [*args, flag, value]


def dsrun_command(job: Job, script_args: list[str], extra_launcher_args: tuple[str, ...] = ()) -> list[str]:
    """argv of a dsrun launch of the job's script with `script_args`."""
    return [sys.executable, "-m", "dsrun.launcher.cli", *job.launcher_args, *extra_launcher_args, job.script,
            *script_args]


def run_trial(job: Job, name: str, config: dict[str, Any], exps_dir: Path, *, arg_mappings: dict[str, str] | None,
              activation_checkpointing: bool | None, end_profile_step: int, overwrite: bool) -> TrialOutcome:
    """Launch one trial and wait for it; never raises for a failing trial (its outcome says why).

    With `overwrite` false a result already in exps_dir/name is reused
    without a launch.
    """
    folder = (exps_dir / name).resolve()
    result_path = folder / "result.json"
    if not overwrite and result_path.is_file():
        try:
            return TrialOutcome("ok", read_result(result_path), "reused", 0.0)
        except ResultError:
            pass  # an unusable old result: run it again
    folder.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    config_path = folder / "ds_config.json"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    argv = dsrun_command(job, script_args_for(job.script_args, config_path, config, arg_mappings,
                                              activation_checkpointing),
                         ("--env", f"{AUTOTUNING_RESULT.name}={result_path}"))
    (folder / "cmd.txt").write_text(" ".join(argv) + "\n")
    start = time.monotonic()
    with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
        returncode = subprocess.run(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, check=False).returncode
    seconds = time.monotonic() - start
    stderr = (folder / "stderr.log").read_text(errors="replace")
    if returncode == 0 and result_path.is_file():
        try:
            return TrialOutcome("ok", read_result(result_path), "", seconds)
        except ResultError as exc:
            return TrialOutcome("failed", None, str(exc), seconds)
    return TrialOutcome("failed", None, failure_reason(returncode, stderr, end_profile_step), seconds)

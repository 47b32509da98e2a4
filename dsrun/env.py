"""Every `DSRUN_*` environment variable dsrun reads, declared once with a typed reader.

[Note: environment variables]
dsrun's behaviour is set by the JSON/YAML config and the launcher's options;
the variables below are the few switches that must work before a config is
read (the launcher, the per-node agent, the native-op build, the rank
rendezvous) or that tune one machine rather than a job. Each is declared
here once, with its type, default and meaning, and every other module of
dsrun reads it through that declaration (`HOST_CACHE_MB.read()`), never
through `os.environ`: tests/test_env.py walks dsrun/ to keep it so, and the
table on docs/config.md is generated from `VARIABLES`.

A variable that is unset or empty (spaces only) takes its default. A value
that does not parse raises `EnvVarError` naming the variable, the value and
what is expected. The launcher *sets* DSRUN_JOB_ID, DSRUN_RENDEZVOUS_TIMEOUT,
DSRUN_RESTART_COUNT and DSRUN_PROGRESS for its ranks (dsrun/launcher/env.py) with plain
environment dicts; only reading goes through this module.

This module must not import torch: the launcher and the agents use it.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class EnvVarError(ValueError):
    """A `DSRUN_*` variable holds a value its reader cannot accept; the message names both."""


@dataclass(frozen=True)
class EnvVar:
    """One `DSRUN_*` variable: its name, default and meaning, and how its text is parsed.

    Subclasses give `expected` (what a valid value looks like, for errors and
    the docs table) and `parse` (text -> value, None when the text is not
    valid). `read()` returns `default` when the variable is unset or blank.
    """
    name: str
    default: Any
    meaning: str

    expected = "a value"

    def parse(self, raw: str) -> Any:
        raise NotImplementedError

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The variable's value in `environ` (default: os.environ), parsed.

        Raises:
            EnvVarError: the value is set but not of the expected form.
        """
        raw = (os.environ if environ is None else environ).get(self.name, "")
        if not raw.strip():
            return self.default
        value = self.parse(raw.strip())
        if value is None:
            raise EnvVarError(f"{self.name}={raw!r}: expected {self.expected} ({self.name}: {self.meaning})")
        return value

    @property
    def default_text(self) -> str:
        """The default as shown in the docs table."""
        return "unset" if self.default is None else str(self.default)


@dataclass(frozen=True)
class Flag(EnvVar):
    """A switch: 1 (on) or 0 (off); read as a bool."""
    expected = "0 or 1"

    def parse(self, raw: str) -> bool | None:
        return {"0": False, "1": True}.get(raw)

    @property
    def default_text(self) -> str:
        return str(int(self.default))


@dataclass(frozen=True)
class Count(EnvVar):
    """A whole number >= 0 in `unit`s; read as an int."""
    unit: str = ""

    @property
    def expected(self) -> str:
        return f"a whole number of {self.unit} >= 0"

    def parse(self, raw: str) -> int | None:
        return int(raw) if raw.isdigit() else None


@dataclass(frozen=True)
class Seconds(EnvVar):
    """A finite number of seconds, > 0 (or >= 0 where `zero_allowed`); read as a float."""
    zero_allowed: bool = False

    @property
    def expected(self) -> str:
        return "a number of seconds " + (">= 0" if self.zero_allowed else "> 0")

    def parse(self, raw: str) -> float | None:
        try:
            value = float(raw)
        except ValueError:
            return None
        ok = math.isfinite(value) and (value >= 0 if self.zero_allowed else value > 0)
        return value if ok else None

    @property
    def default_text(self) -> str:
        return "unset" if self.default is None else f"{self.default:g}"


@dataclass(frozen=True)
class Choice(EnvVar):
    """One of the names in `choices`; read as that name."""
    choices: tuple[str, ...] = ()

    @property
    def expected(self) -> str:
        return f"one of {', '.join(self.choices)}"

    def parse(self, raw: str) -> str | None:
        return raw if raw in self.choices else None


@dataclass(frozen=True)
class PathVar(EnvVar):
    """A file-system path, taken as written (no `~` expansion); read as a Path."""
    expected = "a path"

    def parse(self, raw: str) -> Path | None:
        return None if "\0" in raw else Path(raw)


@dataclass(frozen=True)
class Names(EnvVar):
    """Comma-separated names (letters, digits, `_`, `.`, `-`); read as a frozenset."""
    expected = "comma-separated names such as a,b"

    def parse(self, raw: str) -> frozenset[str] | None:
        names = frozenset(n.strip() for n in raw.split(",") if n.strip())
        return names if all(_NAME.fullmatch(n) for n in names) else None

    @property
    def default_text(self) -> str:
        return ",".join(sorted(self.default)) or "empty"


@dataclass(frozen=True)
class Text(EnvVar):
    """Any non-blank text; read as written."""
    expected = "some text"

    def parse(self, raw: str) -> str:
        return raw


AUTOTUNING_RESULT = PathVar("DSRUN_AUTOTUNING_RESULT", None,
                            "file where rank 0 writes an autotuning trial's measurements (set by `dsrun "
                            "--autotuning` for each trial; with autotuning.enabled the run stops after "
                            "autotuning.end_profile_step)")
BUILD_OPS = Flag("DSRUN_BUILD_OPS", False,
                 "1: `pip install --no-build-isolation .` builds every native op ahead of time (read by setup.py)")
CKPT_BARRIER_TIMEOUT = Seconds("DSRUN_CKPT_BARRIER_TIMEOUT", 120.0,
                               "seconds every rank waits for the others to reach a checkpoint save or load before "
                               "failing (read when dsrun.runtime.checkpoint is imported)")
CKPT_TIMEOUT = Seconds("DSRUN_CKPT_TIMEOUT", 1800.0,
                       "seconds the ranks wait for the slowest one to finish writing its part of a checkpoint "
                       "(read when dsrun.runtime.checkpoint is imported)")
COMM_OVERLAP = Choice("DSRUN_COMM_OVERLAP", "thread",
                      "how overlapped all-reduces run on a shared-memory group: on a communication thread, "
                      "on the caller's thread (sync), or with torch.distributed",
                      choices=("sync", "thread", "torch"))  # ordered: ranks that differ agree on the first
CPU_ISA = Choice("DSRUN_CPU_ISA", None,
                 "instruction set of the CPU ops (Adam, quantizer); unset: the best this CPU has",
                 choices=("scalar", "avx2", "avx512"))  # ordered: the native ops' index of each
HEARTBEAT_FILE = PathVar("DSRUN_HEARTBEAT_FILE", None,
                         "file through which a rank tells its node agent that it makes progress (set by the "
                         "launcher unless --hang_timeout is 0; see docs/launcher.md, Hung ranks)")
HOST_CACHE_MB = Count("DSRUN_HOST_CACHE_MB", None,
                      "cap of the caching host allocator in MiB; 0 turns it off; unset: bounded by the peak "
                      "of live host tensors alone", unit="MiB")
HOST_HUGEPAGES = Flag("DSRUN_HOST_HUGEPAGES", True,
                      "1: large host blocks on transparent huge pages; 0: 4 KiB pages")
JOB_ID = Text("DSRUN_JOB_ID", None,
              "unique id of the job, set by the launcher for every rank; names swap files and shared-memory segments")
MALLOC = Flag("DSRUN_MALLOC", True,
              "1: glibc's mmap threshold is fixed at 1 MiB so freed tensors leave RSS; 0: glibc's default")
OPS_CACHE = PathVar("DSRUN_OPS_CACHE", None,
                    "directory of the native-op build cache; unset: $XDG_CACHE_HOME/dsrun/ops "
                    "(~/.cache/dsrun/ops)")
OPS_DISABLE = Names("DSRUN_OPS_DISABLE", frozenset(),
                    "native ops not to build or load (their PyTorch fallbacks run); \"all\" disables every one")
PROGRESS = Flag("DSRUN_PROGRESS", False,
                "1 (set by the launcher): rank 0's engine prints progress records for the launcher's progress bar")
PROGRESS_INTERVAL = Seconds("DSRUN_PROGRESS_INTERVAL", 10.0,
                            "seconds between the launcher's plain progress lines when its output is not a terminal",
                            zero_allowed=True)
RESTART_COUNT = Count("DSRUN_RESTART_COUNT", 0,
                      "restarts of the job before this attempt, set by the launcher for every rank "
                      "(dsrun --max_restarts; also as TORCHELASTIC_RESTART_COUNT); 0 on the first run",
                      unit="restarts")
RENDEZVOUS_TIMEOUT = Seconds("DSRUN_RENDEZVOUS_TIMEOUT", None,
                             "seconds the ranks wait for each other at start (set by the launcher from "
                             "--rendezvous_timeout); unset: init_distributed's timeout")
SHM_COMM = Flag("DSRUN_SHM_COMM", True,
                "1: collectives of ranks on one node, and pipeline sends between them, go through shared "
                "memory where they apply; 0: torch.distributed for every collective and send")
SHM_TIMEOUT = Seconds("DSRUN_SHM_TIMEOUT", 300.0,
                      "seconds a rank waits for the others inside a shared-memory collective or pipeline "
                      "send/receive before failing")
STRICT_CONFIG = Flag("DSRUN_STRICT_CONFIG", False,
                     "1: unknown config keys and checkpoint paths that differ between ranks are errors, "
                     "not warnings")
ZERO_WATCHDOG_TIMEOUT = Seconds("DSRUN_ZERO_WATCHDOG_TIMEOUT", 300.0,
                                "seconds a ZeRO stage-3 rank waits in one collective before the watchdog "
                                "reports it; 0 turns the watchdog off", zero_allowed=True)

VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    AUTOTUNING_RESULT, BUILD_OPS, CKPT_BARRIER_TIMEOUT, CKPT_TIMEOUT, COMM_OVERLAP, CPU_ISA, HEARTBEAT_FILE,
    HOST_CACHE_MB, HOST_HUGEPAGES, JOB_ID, MALLOC, OPS_CACHE, OPS_DISABLE, PROGRESS, PROGRESS_INTERVAL,
    RENDEZVOUS_TIMEOUT, RESTART_COUNT, SHM_COMM, SHM_TIMEOUT, STRICT_CONFIG, ZERO_WATCHDOG_TIMEOUT)}


def markdown_table() -> str:
    """Markdown: one row per variable (name, accepted values, default, meaning), sorted by name."""
    rows = ["| variable | value | default | meaning |", "|---|---|---|---|"]
    for name, var in sorted(VARIABLES.items()):
        rows.append(f"| `{name}` | {var.expected} | {var.default_text} | {var.meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)

"""Which environment variables travel from the head to ranks on other nodes.

A rank on a remote node starts from that node's login environment, so the
head sends the variables a job usually depends on (DeepSpeed #91, #3489,
#3965, #4370 are reports of them going missing). In increasing precedence:

1. the head's variables whose names start with one of `PREFIXES`;
2. `.deepspeed_env` then `.dsrun_env`, first in the home directory, then in
   the working directory (`K=V` lines; `#` comments, blank lines and an
   optional leading `export ` are allowed; matching quotes around V are
   removed);
3. `--env` flags: `--env NAME` forwards dsrun's own value of NAME (the way
   to pass a secret: `--env K=V` puts the value in dsrun's command line,
   which every local user can read in `ps`), `--env K=V` sets it.

The values travel inside the job description on the agent's stdin, never on
a command line, and are never printed: `masked` is what `--print_env` shows.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

PREFIXES = ("NCCL_", "PYTHON", "CUDA_", "TORCH_", "OMP_", "MKL_", "HF_", "WANDB_")
ENV_FILES = (".deepspeed_env", ".dsrun_env")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvFileError(ValueError):
    """A malformed `--env` value or env-file line; the message says where and how to fix it."""


def parse_assignment(text: str, where: str) -> tuple[str, str]:
    """Split `K=V` (optionally `export K=V`) into (K, V).

    Raises:
        EnvFileError: no `=`, or K is not a valid variable name; `where` (e.g.
            "~/.dsrun_env:3" or "--env") starts the message.
    """
    body = text.strip()
    if body.startswith("export "):
        body = body[len("export "):].lstrip()
    key, eq, value = body.partition("=")
    key = key.strip()
    if not eq or not _NAME.match(key):
        raise EnvFileError(f"{where}: expected NAME=VALUE with NAME made of letters, digits and '_', "
                           f"got {text.strip()!r}")
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return key, value


def read_env_file(path: Path) -> dict[str, str]:
    """Parse one env file (see the module docstring for the grammar)."""
    out: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, value = parse_assignment(line, f"{path}:{lineno}")
        out[key] = value
    return out


def env_file_paths(cwd: Path, home: Path | None = None) -> list[Path]:
    """Existing env files in precedence order (later wins)."""
    home = Path(os.path.expanduser("~")) if home is None else home
    dirs = [home] if home.resolve() == cwd.resolve() else [home, cwd]
    return [d / name for d in dirs for name in ENV_FILES if (d / name).is_file()]


def propagated_env(environ: Mapping[str, str], cwd: Path, overrides: Iterable[str] = (),
                   home: Path | None = None) -> dict[str, str]:
    """The variables sent to every rank on every node.

    Args:
        environ: the head's environment (usually os.environ).
        cwd: the job's working directory (where `.dsrun_env` is looked up).
        overrides: `--env` values, each `K=V` or a bare `NAME` (its value
            taken from `environ`).
        home: home directory for env files (default: the user's).

    Raises:
        EnvFileError: a malformed env-file line or `--env` value, or
            `--env NAME` with NAME not set in `environ`.
    """
    env = {k: v for k, v in environ.items() if k.startswith(PREFIXES)}
    for path in env_file_paths(cwd, home):
        env.update(read_env_file(path))
    for item in overrides:
        if _NAME.match(item.strip()):
            name = item.strip()
            if name not in environ:
                raise EnvFileError(f"--env {name}: {name} is not set in dsrun's environment; export it first "
                                   f"(or write --env {name}=VALUE for a value that is not secret)")
            env[name] = environ[name]
            continue
        key, value = parse_assignment(item, "--env")
        env[key] = value
    return env


def masked(env: Mapping[str, str]) -> list[str]:
    """`K=<N chars>` lines, sorted, for showing which variables are set without their values."""
    return [f"{k}=<{len(v)} chars>" for k, v in sorted(env.items())]

"""examples/train_gpt.py through the `dsrun` launcher, shortened, for the slow example tests.

[Note: one launch per distinct run]
Most example tests compare two runs (a parallel layout against a reference
on fewer ranks), and several references are the same run: the 2-stage
pipeline on 2 ranks, one rank of gpt_demo.json, 2 data-parallel ranks of
gpt_demo.json. A launch costs mostly its ranks' start (importing torch,
reading the corpus, initialize), not its steps, so `GptRuns` starts each
distinct run once per test session (tests/examples/conftest.py `gpt_run`)
and every test that needs it reads the same (before, after, drop) triple.
A run that fails is not kept: the next test that asks starts it again.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SUMMARY = re.compile(r"validation loss: before (\d+\.\d+)\s+after (\d+\.\d+)\s+drop (-?\d+\.\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workdir: Path, num_procs: int, steps: int, *flags: str, config_name: str = "gpt_demo.json",
           drop: tuple[str, ...] = (), eval_batches: int = 4) -> tuple[float, float, float]:
    """Run train_gpt.py for `steps` steps on `num_procs` ranks via the `dsrun` entry point.

    The config (a name under examples/configs, or an absolute path) gets its
    scheduler fitted to `steps` (4 warm-up steps) and the keys in `drop`
    removed; the model is 2 layers of width 64 on windows of 64 bytes.

    Returns:
        (validation loss before, after, drop) in nats/byte as rank 0 prints them.

    Raises:
        AssertionError: the launch failed or rank 0 did not print one summary line.
    """
    cfg = json.loads((EXAMPLES / "configs" / config_name).read_text())
    cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=4)
    for key in drop:
        del cfg[key]
    cfg_path = workdir / Path(config_name).name
    cfg_path.write_text(json.dumps(cfg))
    cmd = [str(Path(sys.executable).parent / "dsrun"), "--num_procs", str(num_procs),
           "--master_port", str(_free_port()), str(EXAMPLES / "train_gpt.py"),
           "--config", str(cfg_path), "--steps", str(steps), "--n_layer", "2", "--n_embd", "64",
           "--seq_len", "64", "--eval_batches", str(eval_batches), *flags]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    found = SUMMARY.findall(out)
    assert len(found) == 1, f"expected one summary line from rank 0:\n{out}"
    before, after, dropped = map(float, found[0])
    return before, after, dropped


class GptRuns:
    """`launch` with each distinct run started once; see [Note: one launch per distinct run].

    Args:
        new_dir: returns a fresh empty directory for one launch (pytest's tmp_path_factory.mktemp).
    """

    def __init__(self, new_dir: Callable[[], Path]):
        self._new_dir = new_dir
        self._done: dict[tuple, tuple[float, float, float]] = {}

    def __call__(self, num_procs: int, steps: int, *flags: str, config_name: str = "gpt_demo.json",
                 drop: tuple[str, ...] = (), eval_batches: int = 4) -> tuple[float, float, float]:
        """`launch`'s result for these arguments, launching only the first time they are asked for."""
        key = (num_procs, steps, flags, config_name, tuple(drop), eval_batches)
        if key not in self._done:
            self._done[key] = launch(self._new_dir(), num_procs, steps, *flags, config_name=config_name,
                                     drop=drop, eval_batches=eval_batches)
        return self._done[key]

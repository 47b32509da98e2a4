"""CPU seconds of a real rank from start to exit, and what its exit costs.

    PYTHONPATH=$PWD .venv/bin/python bench/launcher/rank_exit.py [--repeat 6] [--base TREE]

A node's launcher work (fanout.py, node_cost.py) uses ranks that import
nothing. A real rank imports torch and dsrun, which costs it more than the
whole launcher costs its node. Each run here starts the 2 ranks of a gloo
job by hand (no launcher): import torch, `init_distributed`, one all-reduce
of 4 floats, exit. Cases, repeated `--repeat` times and interleaved:

- `this tree`: the rank exits normally (dsrun's exit handler, then the
  interpreter's teardown; see [Note: a cheap exit] in
  dsrun/runtime/distributed/exit.py).
- `base` (with `--base TREE`, a worktree of another commit): the same with
  that tree's dsrun.
- `os._exit`: this tree's rank ends with os._exit(0) right after its
  all-reduce: no exit handler, no teardown. The floor: a case minus this
  is what its exit costs.

Prints CPU seconds per rank (user + system of both ranks, halved) as min,
median and spread (max - min).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout import compile_trees  # noqa: E402
from tests.dist_helpers import free_port  # noqa: E402

RANK_SCRIPT = """\
import os, sys
import torch
import torch.distributed as dist
from dsrun.runtime.distributed.dist import init_distributed
init_distributed()
t = torch.ones(4)
dist.all_reduce(t)
assert t.tolist() == [2.0] * 4
if sys.argv[1] == "os_exit":
    os._exit(0)
"""


class PortTaken(RuntimeError):
    """Rank 0 could not listen on the port it was given."""


def _run(script: Path, tree: Path, mode: str) -> float:
    """CPU seconds per rank of one 2-rank run of `script` with `tree`'s dsrun; a run whose port was taken
    between free_port() and rank 0 listening (other jobs on the machine) is run again."""
    for _ in range(3):
        try:
            return _run_once(script, tree, mode, str(free_port()))
        except PortTaken:
            continue
    raise RuntimeError("three runs in a row found their rendezvous port taken")


def _run_once(script: Path, tree: Path, mode: str, port: str) -> float:
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
        procs.append(subprocess.Popen([sys.executable, str(script), mode], cwd=tree, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for proc in procs:
        err = proc.communicate(timeout=600)[1].decode()
        if proc.returncode != 0:
            for other in procs:  # the peer would wait for its rendezvous until it times out
                other.kill()
                other.wait()
            if "EADDRINUSE" in err:
                raise PortTaken(err)
            raise RuntimeError(f"a rank of {tree} ({mode}) exited {proc.returncode}: {err[-2000:]}")
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--base", type=Path, help="a worktree of another commit, measured beside this one")
    args = parser.parse_args()
    cases = {"this tree": (ROOT, "exit"), **({"base": (args.base.resolve(), "exit")} if args.base else {}),
             "os._exit": (ROOT, "os_exit")}
    compile_trees({tree for tree, _ in cases.values()})
    samples: dict[str, list[float]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK_SCRIPT)
        for rep in range(args.repeat):
            for name, (tree, mode) in cases.items():
                samples[name].append(_run(script, tree, mode))
            print(f"rep {rep} done", file=sys.stderr, flush=True)
    print(f"2 ranks, {args.repeat} repetitions; CPU seconds per rank")
    print(f"{'case':12} {'min s':>7} {'median s':>9} {'spread s':>9}")
    for name, values in samples.items():
        print(f"{name:12} {min(values):7.3f} {statistics.median(values):9.3f} {max(values) - min(values):9.3f}")
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end)")


if __name__ == "__main__":
    main()

"""The runtime tears down the process group it created at a clean exit, and only
then (issue 11, item 15): torch 2.13's gloo can abort a finished rank during
interpreter teardown (exit 134) when the group is still alive.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]

# A finished training script that never destroys its process group itself.
_RANK = """\
import sys
import torch
import torch.distributed as dist
from dsrun.runtime.dist import init_distributed

real_destroy = dist.destroy_process_group
def destroy(*args, **kwargs):
    print("destroyed", flush=True)
    real_destroy(*args, **kwargs)
dist.destroy_process_group = destroy

topology = init_distributed()
t = torch.ones(4)
dist.all_reduce(t)
assert t.tolist() == [2.0] * 4
if sys.argv[1] == "raise" and topology.rank == 0:
    raise RuntimeError("failing rank")
print("done", flush=True)
"""


def _run_pair(script: Path, mode: str) -> list[subprocess.CompletedProcess]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, str(script), mode], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_process_group_destroyed_at_clean_exit_only(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    clean = _run_pair(script, "clean")
    for proc in clean:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["done", "destroyed"]
    failing, other = _run_pair(script, "raise")
    assert failing.returncode == 1 and "RuntimeError: failing rank" in failing.stderr
    assert "destroyed" not in failing.stdout, "the process group was torn down after an exception"
    assert other.returncode == 0 and other.stdout.split() == ["done", "destroyed"], other.stderr


# 50 back-to-back 2-rank jobs, each rank a fork of one process that imported
# torch once (spawning 100 fresh interpreters costs minutes on 2 cores). A
# forked rank still ends by a normal interpreter exit -- atexit handlers,
# finalisation, C++ static destructors -- which is where gloo aborts.
_RUNS = """\
import os, socket, sys
import torch
import torch.distributed as dist
from dsrun.runtime.dist import init_distributed

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

codes = []
for run in range(int(sys.argv[1])):
    master_port, pids = str(port()), []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=master_port)
            init_distributed()
            t = torch.ones(4)
            dist.all_reduce(t)
            sys.exit(0 if t.tolist() == [2.0] * 4 else 3)  # a normal interpreter exit
        pids.append(pid)
    codes += [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
print("codes", *codes)
"""


@pytest.mark.slow
def test_fifty_back_to_back_two_rank_runs_all_exit_0(tmp_path):
    script = tmp_path / "runs.py"
    script.write_text(_RUNS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script), "50"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = [int(c) for c in proc.stdout.split("codes", 1)[1].split()]
    assert len(codes) == 100
    failed = {i: c for i, c in enumerate(codes) if c != 0}
    assert not failed, f"runs/ranks that failed (index = 2 x run + rank: exit code): {failed}\n" \
                       f"{proc.stderr[-3000:]}"

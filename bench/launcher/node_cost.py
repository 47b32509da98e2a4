"""Where one SSH node's start-up CPU goes: a per-node breakdown of `fanout.py`'s `dsrun start N hosts`.

    PYTHONPATH=$PWD .venv/bin/python bench/launcher/node_cost.py [--hosts 16] [--repeat 3] [--base TREE]

Same loopback sshd and hosts as fanout.py (tests/multinode/sshd.py). Every
figure is CPU seconds of what the sshd ran (its reaped children: per-connection
sshd processes, login shells, Pythons), divided by the number of hosts, so
it is the cost of one simulated node, independent of the load on the machine
(wall seconds are not). Each repetition runs every stage once over all hosts
at `--ssh_parallelism`-like concurrency (stages interleaved, A B A B), and
each row is the difference of two cumulative stages:

- `SSH connection`: paramiko connects (key exchange, public-key login) and
  disconnects; no session.
- `session + login shell`: a session running `exit 0`, minus the connection:
  sshd's session set-up and the user's shell, which reads ~/.bashrc because
  sshd runs it (bash does so for commands from sshd).
- `  of which ~/.bashrc`: measured locally, `bash -c '. ~/.bashrc'` minus
  `bash -c :` (the same work the shell above does; here root's runs `pyenv init`).
- `Python start`: `cd TREE && exec PYTHON -c pass`, minus the shell.
- `agent imports`: `... -c 'import dsrun.launcher.agent'`, minus Python start.
- `2 ranks` (fanout.py's rank script, which imports only os/sys/time): measured
  locally, two `PYTHON rank.py` runs.
- `rest of the agent`: the whole `dsrun start` per node (fanout.py's case:
  the agent's bootstrap, its job, its two ranks, teardown) minus all the rows
  above: the bootstrap's probes, the watchdog fork, spawning and watching
  the ranks, sshd relaying their output.
- `whole node`: fanout.py's `dsrun start`, node CPU / hosts.
- `agent alone (local)`: `PYTHON -m dsrun.launcher.agent` given a 2-rank
  job of the same rank script on stdin, no sshd, minus its imports
  (`-c 'import dsrun.launcher.agent'`) and minus `2 ranks`: the agent's own
  run measured directly, not as a difference of sshd stages.

With `--base TREE` (a worktree of another commit, e.g. main), the rows that
depend on dsrun's code (agent imports, rest, whole node) are measured for
both trees in the same run, interleaved; the head and the agents then run
with that tree as working directory (which Python puts first on sys.path),
with this tree's Python and this tree's benchmark code.
Prints min, median and spread (max - min) of each row in CPU milliseconds.
"""
from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout import RANK_SCRIPT, _sshd_children_cpu, _wait_sessions_gone, compile_trees, run_case  # noqa: E402
from tests.multinode.sshd import loopback_sshd  # noqa: E402

from dsrun.launcher.job import NodeJob  # noqa: E402
from dsrun.launcher.ssh import DEFAULT_SSH_PARALLELISM, connect_all, load_ssh_config  # noqa: E402


def _local_cpu(argv: list[str], tree: Path | None = None) -> float:
    """CPU seconds of one local run of `argv` (it must exit 0), as rank 0 of 2, in `tree` if given."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", **({"PYTHONPATH": str(tree)} if tree else {}))
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=tree, env=env)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime


def _local_agent_cpu(argv: list[str], job: NodeJob, tree: Path) -> float:
    """CPU seconds of one local agent run of `job` (its ranks included), started in `tree`; stdin stays open."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(argv, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.stdin.write(job.to_json_line().encode())
    proc.stdin.flush()
    if proc.wait(120) != 0:
        raise RuntimeError(f"the agent in {tree} exited {proc.returncode}")
    proc.stdin.close()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime


def _sessions_cpu(hosts: list[str], config, sshd_pid: int, command: str | None) -> float:
    """sshd CPU seconds per host for connecting to every host, running `command` in one session each (None: no
    session), and disconnecting."""
    before = _sshd_children_cpu(sshd_pid)
    conns = connect_all(hosts, config, None)
    try:
        if command is not None:
            def one(conn) -> None:
                chan = conn.client.get_transport().open_session()
                chan.exec_command(command)
                out = chan.makefile_stderr("rb").read()
                if chan.recv_exit_status() != 0:
                    raise RuntimeError(f"{command!r} failed on {conn.target.alias}: {out.decode()[-500:]}")

            with ThreadPoolExecutor(max_workers=min(DEFAULT_SSH_PARALLELISM, len(hosts))) as pool:
                list(pool.map(one, conns.values()))
    finally:
        for conn in conns.values():
            conn.close()
    _wait_sessions_gone(sshd_pid)
    return (_sshd_children_cpu(sshd_pid) - before) / len(hosts)


def _row(name: str, samples: list[float]) -> str:
    ms = [1000 * s for s in samples]
    return f"{name:34} {min(ms):8.1f} {statistics.median(ms):9.1f} {max(ms) - min(ms):9.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--base", type=Path, help="a worktree of another commit, measured beside this one")
    args = parser.parse_args()
    trees = {"this tree": ROOT, **({"base": args.base.resolve()} if args.base else {})}
    compile_trees(trees.values())
    py = sys.executable
    cum: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        cum.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "sshd").mkdir()
        rank = d / "rank.py"
        rank.write_text(RANK_SCRIPT)
        with loopback_sshd(d / "sshd") as cluster:
            cfg, hostfile = cluster.write_many_hosts(args.hosts, 2)
            config = load_ssh_config(cfg)
            hosts = [f"host-{i:03d}" for i in range(args.hosts)]
            sshd = cluster.proc.pid
            job = NodeJob(job_id="node-cost", node_rank=0, nnodes=1, world_size=2, ranks=[0, 1], local_ranks=[0, 1],
                          master_addr="127.0.0.1", master_port=29400, command=[py, str(rank)], cwd=str(d))
            for rep in range(args.repeat):
                add("connection", _sessions_cpu(hosts, config, sshd, None))
                add("shell", _sessions_cpu(hosts, config, sshd, "exit 0"))
                add("python", _sessions_cpu(hosts, config, sshd, f"cd {shlex.quote(str(ROOT))} && exec {py} -c pass"))
                add("bash", _local_cpu(["bash", "-c", ":"]))
                add("bashrc", _local_cpu(["bash", "-c", ". ~/.bashrc"]))
                add("ranks", 2 * _local_cpu([py, str(rank)]))
                for label, tree in trees.items():
                    cd = f"cd {shlex.quote(str(tree))} && exec {py}"
                    add(f"imports {label}", _sessions_cpu(hosts, config, sshd,
                                                          f"{cd} -c 'import dsrun.launcher.agent'"))
                    argv = [py, "-m", "dsrun.launcher.cli", "--no_local_rank", "--grace_period", "5",
                            "--hostfile", str(hostfile), "--ssh_config", str(cfg), str(rank)]
                    _, _, node = run_case(argv, 2 * args.hosts, None, sshd, tree, dict(os.environ, PYTHONPATH=str(tree)))
                    add(f"node {label}", node / args.hosts)
                    add(f"agent {label}", _local_agent_cpu([py, "-m", "dsrun.launcher.agent"], job, tree))
                    add(f"agent imports {label}", _local_cpu([py, "-c", "import dsrun.launcher.agent"], tree))
                print(f"rep {rep} done", file=sys.stderr, flush=True)

    def diff(a: str, b: str) -> list[float]:
        return [x - y for x, y in zip(cum[a], cum[b])]

    print(f"{args.hosts} hosts x 2 ranks, {args.repeat} repetitions; CPU ms per node")
    print(f"{'stage':34} {'min ms':>8} {'median ms':>9} {'spread ms':>9}")
    print(_row("SSH connection", cum["connection"]))
    print(_row("session + login shell", diff("shell", "connection")))
    print(_row("  of which ~/.bashrc (local)", diff("bashrc", "bash")))
    print(_row("Python start", diff("python", "shell")))
    for label in trees:
        print(_row(f"agent imports ({label})", diff(f"imports {label}", "python")))
    print(_row("2 ranks (local)", cum["ranks"]))
    for label in trees:
        rest = [n - i - r for n, i, r in zip(cum[f"node {label}"], cum[f"imports {label}"], cum["ranks"])]
        print(_row(f"rest of the agent ({label})", rest))
    for label in trees:
        print(_row(f"whole node ({label})", cum[f"node {label}"]))
    for label in trees:
        own = [a - i - r for a, i, r in zip(cum[f"agent {label}"], cum[f"agent imports {label}"], cum["ranks"])]
        print(_row(f"agent alone (local, {label})", own))
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end)")


if __name__ == "__main__":
    main()

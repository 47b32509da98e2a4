"""SSH fan-out: start-up and fail-fast time of dsrun for 2, 16, 64 hosts x 2 ranks over a real loopback sshd.

    .venv/bin/python bench/launcher/fanout.py [--hosts 2,16,64] [--repeat 3] [--no_torchrun] [--base TREE]

Every host is an alias (host-000, host-001, ...) of one of this machine's
loopback addresses, served by one OpenSSH sshd (tests/multinode/sshd.py);
dsrun reaches each over paramiko as it would a real node, with one
connection, one session and one agent per host. The ranks import nothing
but `os`/`time`, so what is measured is the launcher.

Cases, repeated `--repeat` times and interleaved (one repetition of every
case, then the next), so machine noise hits all alike:
- `start N`: from starting `dsrun` to the last of the 2N ranks printing its
  RANK and WORLD_SIZE (each checked); the ranks then exit.
- `fail N`: every rank starts and sleeps; once all 2N are up, the last rank
  is told to exit 1 (it polls a file every 10 ms); measured from that
  moment to `dsrun` having exited and no process of the job being left
  under the sshd (psutil).
- `torchrun start/fail` (one node: `--nnodes 1 --nproc_per_node 2`, the
  CPU torch of this Python): the same two measures for what torchrun does
  per node. dsrun starts one agent per host; torchrun would be started once
  per host by the user (pdsh/srun), so its figure is a per-node cost.
- `dry_run 1024`: `dsrun --dry_run` of a 1024-host hostfile, 8 slots each.
- with `--base TREE` (a worktree of another commit, e.g. main), `base start
  N` and `base fail N`: the same cases with that tree's dsrun (head and
  agents run with TREE as working directory, which Python puts first on
  sys.path), interleaved with this tree's, so old and new code meet the same
  load.

Prints min, median and spread (max - min) of each case, seconds, and the
median CPU seconds of the whole launch (start to end, teardown included):
`head CPU` is the launcher process (for torchrun: torchrun and its ranks,
all on its one node), `node CPU` is what the sshd ran for dsrun (SSH
connections, login shells, agents, ranks). On a real cluster each node's
share of `node CPU` runs on that node, in parallel; here all "nodes" share
this machine's CPUs, so with many hosts the wall time is bound by
`node CPU / CPUs` and by what else runs (the load average is printed).
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.multinode.sshd import loopback_sshd  # noqa: E402

RANK_SCRIPT = """\
import os, sys, time
print("UP", os.environ["RANK"], os.environ["WORLD_SIZE"], flush=True)
if len(sys.argv) > 1:  # fail mode: sleep; the last rank exits 1 once the trigger file exists
    trigger, last = sys.argv[1], int(os.environ["WORLD_SIZE"]) - 1
    while int(os.environ["RANK"]) != last or not os.path.exists(trigger):
        time.sleep(0.01 if int(os.environ["RANK"]) == last else 60)
    sys.exit(1)
"""
UP = re.compile(rb"UP (\d+) (\d+)")
# The launches under way, each the leader of a session of its own. Whatever ends this bench -- an error,
# Ctrl-C, SIGTERM, SIGHUP -- kills the process tree and group of each one still running, so no torchrun
# rank is left sleeping (the fail case's ranks sleep 60 s at a time). The tree is needed: torchrun starts
# every rank in a session of its own, outside the launch's group. A launch already reaped is left alone
# (its pid may belong to another process by then; its ranks were waited for).
_LAUNCHES: list[subprocess.Popen] = []


def _kill_launches() -> None:
    while _LAUNCHES:
        launch = _LAUNCHES.pop()
        if launch.poll() is not None:
            continue
        try:
            leader = psutil.Process(launch.pid)
            tree = [leader, *leader.children(recursive=True)]  # listed before any dies and is reparented
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(launch.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group has exited
            pass
        launch.wait()


def _exit_on_signal(signum: int, _frame) -> None:
    _kill_launches()
    raise SystemExit(128 + signum)


def _watch_up(proc: subprocess.Popen, world: int, started: threading.Event, seen: list[float]) -> None:
    """Read the launcher's stdout; set `started` when all `world` ranks said UP with the right WORLD_SIZE."""
    ranks: set[int] = set()
    for line in iter(proc.stdout.readline, b""):
        m = UP.search(line)
        if m and int(m.group(2)) == world:
            ranks.add(int(m.group(1)))
            if len(ranks) == world and not started.is_set():
                seen.append(time.perf_counter())
                started.set()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _reaped_cpu() -> float:
    """CPU seconds of this process's reaped children (and theirs, once reaped)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _sshd_children_cpu(sshd_pid: int) -> float:
    """CPU seconds of everything sshd ran and reaped: connections, login shells, agents, ranks."""
    t = psutil.Process(sshd_pid).cpu_times()
    return t.children_user + t.children_system


def _wait_sessions_gone(sshd_pid: int) -> None:
    deadline = time.perf_counter() + 30
    while psutil.Process(sshd_pid).children() and time.perf_counter() < deadline:
        time.sleep(0.02)


def run_case(argv: list[str], world: int, trigger: Path | None, sshd_pid: int | None,
             cwd: Path, env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """One launch; returns (seconds measured, head CPU s, node CPU s). See the module doc for what is measured.

    Head CPU: the launcher process (dsrun's head; for torchrun, torchrun and
    its ranks, which all run on the one node). Node CPU: for dsrun, what the
    sshd ran (sessions, login shells, agents, ranks), 0 for torchrun.
    """
    if trigger is not None and trigger.exists():
        trigger.unlink()
    cpu0, node0 = _reaped_cpu(), _sshd_children_cpu(sshd_pid) if sshd_pid else 0.0
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    _LAUNCHES.append(proc)  # see _LAUNCHES
    try:
        return _measure(proc, argv, world, trigger, sshd_pid, t0, cpu0, node0)
    finally:
        _kill_launches()  # a launch that failed to start or to end is stopped


def _measure(proc: subprocess.Popen, argv: list[str], world: int, trigger: Path | None, sshd_pid: int | None,
             t0: float, cpu0: float, node0: float) -> tuple[float, float, float]:
    """The measures of `run_case` for the launch `proc` started at t0."""
    started, seen = threading.Event(), []
    reader = threading.Thread(target=_watch_up, args=(proc, world, started, seen), daemon=True)
    err: list[bytes] = []
    err_reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    err_reader.start()
    if not started.wait(120):
        proc.kill()
        raise RuntimeError(f"{argv[:4]}...: not all {world} ranks started in 120 s:\n{b''.join(err).decode()[-2000:]}")
    if trigger is None:
        measured = seen[0] - t0
        proc.wait(60)
    else:
        job = [p.pid for p in psutil.Process(sshd_pid or proc.pid).children(recursive=True)]
        trigger.touch()
        t1 = time.perf_counter()
        proc.wait(60)
        while any(_alive(p) for p in job):
            if time.perf_counter() - t1 > 60:
                raise RuntimeError("processes of the job are left 60 s after the failure")
            time.sleep(0.01)
        measured = time.perf_counter() - t1
        if proc.returncode == 0:
            raise RuntimeError(f"the job with a failed rank exited 0: {b''.join(err).decode()[-2000:]}")
    if sshd_pid:
        _wait_sessions_gone(sshd_pid)
    node = _sshd_children_cpu(sshd_pid) - node0 if sshd_pid else 0.0
    return measured, _reaped_cpu() - cpu0, node


def compile_trees(trees) -> None:
    """Byte-compile dsrun in each tree and let every Python of the bench write and use .pyc files.

    With PYTHONDONTWRITEBYTECODE set (as in some shells) a fresh worktree has no
    .pyc files and every Python the bench starts outside sshd compiles each dsrun
    module it imports again (about 30 CPU ms for the agent's modules), so a
    `--base` worktree would look slower than it is.
    """
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    for tree in trees:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(tree) / "dsrun")], check=True,
                       stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,16,64", help="comma-separated host counts (2 ranks each)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no_torchrun", action="store_true")
    parser.add_argument("--base", type=Path, help="a worktree of another commit, run beside this one")
    args = parser.parse_args()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, _exit_on_signal)
    counts = [int(n) for n in args.hosts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "sshd").mkdir()
        (d / "rank.py").write_text(RANK_SCRIPT)
        hf = d / "hosts_1024"
        hf.write_text("".join(f"host-{i:04d} slots=8\n" for i in range(1024)))
        trigger = d / "fail_now"
        dsrun = [sys.executable, "-m", "dsrun.launcher.cli", "--no_local_rank", "--grace_period", "5"]
        with loopback_sshd(d / "sshd") as cluster:
            cases: dict[str, tuple[list[str], int, Path | None, int | None, Path]] = {}
            trees = {"dsrun": ROOT, **({"base": args.base.resolve()} if args.base else {})}
            compile_trees(trees.values())
            for n in counts:
                cfg, hostfile = cluster.write_many_hosts(n, 2)
                base = [*dsrun, "--hostfile", str(hostfile), "--ssh_config", str(cfg), str(d / "rank.py")]
                for label, tree in trees.items():
                    cases[f"{label} start {n} hosts"] = (base, 2 * n, None, cluster.proc.pid, tree)
                    cases[f"{label} fail {n} hosts"] = ([*base, str(trigger)], 2 * n, trigger, cluster.proc.pid, tree)
            if not args.no_torchrun:
                torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                            "--master_port", "0", str(d / "rank.py")]  # 0: a free port each run
                cases["torchrun start 1 node"] = (torchrun, 2, None, None, ROOT)
                cases["torchrun fail 1 node"] = ([*torchrun, str(trigger)], 2, trigger, None, ROOT)
            times: dict[str, list[float]] = {name: [] for name in cases}
            cpus: dict[str, list[float]] = {name: [] for name in cases}
            nodes: dict[str, list[float]] = {name: [] for name in cases}
            failed: dict[str, int] = {}
            times["dsrun dry_run 1024 hosts"], cpus["dsrun dry_run 1024 hosts"] = [], []
            nodes["dsrun dry_run 1024 hosts"] = []
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            os.environ.update(env)
            for rep in range(args.repeat):
                for name, (argv, world, trig, sshd_pid, tree) in cases.items():
                    try:
                        seconds, cpu, node = run_case(argv, world, trig, sshd_pid, tree,
                                                      dict(os.environ, PYTHONPATH=str(tree)))
                    except RuntimeError as exc:  # counted and shown, the other cases go on
                        failed[name] = failed.get(name, 0) + 1
                        print(f"rep {rep} {name}: FAILED: {exc}", file=sys.stderr, flush=True)
                        continue
                    times[name].append(seconds)
                    cpus[name].append(cpu)
                    nodes[name].append(node)
                    print(f"rep {rep} {name}: {seconds:.2f} s", file=sys.stderr, flush=True)
                t0, cpu0 = time.perf_counter(), _reaped_cpu()
                dry = subprocess.run([*dsrun, "--hostfile", str(hf), "--dry_run", str(d / "rank.py")], cwd=ROOT,
                                     capture_output=True)
                times["dsrun dry_run 1024 hosts"].append(time.perf_counter() - t0)
                cpus["dsrun dry_run 1024 hosts"].append(_reaped_cpu() - cpu0)
                nodes["dsrun dry_run 1024 hosts"].append(0.0)
                if dry.returncode != 0:
                    raise RuntimeError(dry.stderr.decode()[-2000:])
    print(f"{'case':26} {'min s':>7} {'median s':>9} {'spread s':>9} {'head CPU s':>11} {'node CPU s':>11}")
    for name, samples in times.items():
        if not samples:
            print(f"{name:26} every run failed")
            continue
        print(f"{name:26} {min(samples):7.2f} {statistics.median(samples):9.2f} {max(samples) - min(samples):9.2f} "
              f"{statistics.median(cpus[name]):11.2f} {statistics.median(nodes[name]):11.2f}")
    for name, count in failed.items():
        print(f"{name}: {count} run(s) failed (see stderr)")
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end)")


if __name__ == "__main__":
    main()

"""Real daemons for the multi-node tests: an OpenSSH server and a Slurm cluster on loopback.

`sshd_cluster` (defined in tests/conftest.py, so tests/faults shares the
one daemon) starts Debian's sshd on a free port, listening on 127.0.0.1
and 127.0.0.2 (both loopback on Linux), with host and client keys generated
in a temporary directory, and writes an ssh config file that maps the host
aliases `node-a` -> 127.0.0.1 and `node-b` -> 127.0.0.2 (tests/multinode/sshd.py,
shared with bench/). The launcher reads that file through `--ssh_config`, so
the tests also prove ~/.ssh/config handling (HostName, Port, User,
IdentityFile, UserKnownHostsFile, ProxyJump). The known_hosts file lists the
server's key for both addresses. Nothing outside loopback is contacted. A
daemon that cannot start fails the test with its log: these tests are the
proof that multi-node launch works, they are never skipped.
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.multinode.sshd import SshCluster, free_port, keygen, loopback_sshd, stop  # noqa: F401 (re-exported)
from tests.system_packages import require_debian_packages


def expected_losses(steps: int) -> list[float]:
    """What scripts/allreduce_train.py computes with equal shards, in one process (the full-batch steps)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * steps, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(8 * steps, 1, generator=g)
    model = torch.nn.Linear(16, 1)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x[step * 8:step * 8 + 8]), y[step * 8:step * 8 + 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@dataclass
class SlurmCluster:
    """A running two-node Slurm (slurmctld + two slurmd + munged) on loopback.

    Both nodes (`n1`, `n2`) are slurmd daemons on this machine with their own
    ports; Slurm commands reach the cluster with `env` (SLURM_CONF set).
    """

    dir: Path
    env: dict[str, str]
    logs: list[Path]

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in self.logs if p.exists())


# Slurm's smallest credential lifetime is 5 s (22.05 src/common/slurm_cred.c refuses less); see
# [Note: how long a requeued job waits] for why it matters here.
CRED_EXPIRE = 5


def _slurm_conf(d: Path, munge_sock: Path, ports: list[int]) -> str:
    ctld, slurmd, n1, n2 = ports
    return f"""\
ClusterName=dsruntest
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={munge_sock},cred_expire={CRED_EXPIRE}
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
ReturnToService=2
SlurmUser=root
SlurmdUser=root
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1,batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
StateSaveLocation={d}/state
SlurmctldPidFile={d}/slurmctld.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdPidFile={d}/slurmd-%n.pid
SlurmdSpoolDir={d}/spool/%n
SlurmdLogFile={d}/slurmd-%n.log
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=2 Port={n1}
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=2 Port={n2}
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    """Start munged, slurmctld and two slurmd configured in a temporary directory.

    [Note: two Slurm nodes on one machine]
    Debian's slurmd accepts `-N NODENAME`, so two daemons with their own
    ports act as nodes n1 and n2 of one cluster; srun then places one task
    per "node" exactly as on a real cluster. proctrack/linuxproc and
    task/none avoid cgroups, which the test machine may not delegate.

    [Note: how long a requeued job waits]
    A requeued job may start again only cred_expire + 1 seconds after the
    requeue (slurmctld sets its begin time so; the credentials of the run
    before must have expired on the nodes: slurm.conf AuthInfo), and then
    only when the scheduler next looks at the queue: sched/builtin does so on
    a submit or a job's end (after batch_sched_delay, default 3 s) or every
    sched_interval (default 60 s). With the defaults (120 s, 60 s) a
    requeue test waits two to three minutes. Here cred_expire is Slurm's
    minimum, 5 s (also how long a step's launch credential is valid; srun on
    loopback presents it within milliseconds), and the scheduler runs every
    second (sched_interval=1) and at once on a submit (batch_sched_delay=0):
    a requeued job starts about 6-7 s after the requeue.
    """
    require_debian_packages("slurm-wlm", "munge")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool/n1", "spool/n2", "munge"):
        (d / sub).mkdir(parents=True)
    (d / "munge").chmod(0o711)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = d / "munge" / "munge.sock"
    conf = d / "slurm.conf"
    conf.write_text(_slurm_conf(d, sock, [free_port() for _ in range(4)]))
    env = dict(os.environ, SLURM_CONF=str(conf))
    logs = [d / "munged.log", d / "slurmctld.out", d / "slurmd-n1.out", d / "slurmd-n2.out",
            d / "slurmctld.log", d / "slurmd-n1.log", d / "slurmd-n2.log"]
    commands = [
        ["munged", "-F", "-f", f"--key-file={key}", f"--socket={sock}", f"--pid-file={d}/munge/munged.pid",
         f"--log-file={d}/munged.log", f"--seed-file={d}/munge/seed"],
        ["slurmctld", "-D", "-f", str(conf)],
        ["slurmd", "-D", "-N", "n1", "-f", str(conf)],
        ["slurmd", "-D", "-N", "n2", "-f", str(conf)],
    ]
    procs: list[subprocess.Popen] = []
    cluster = SlurmCluster(d, env, logs)
    try:
        for cmd, out_name in zip(commands, ("munged.out", "slurmctld.out", "slurmd-n1.out", "slurmd-n2.out")):
            with open(d / out_name, "wb") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
            if cmd[0] == "munged":
                _wait_for(lambda: sock.exists(), 10, "munged socket", procs[-1], cluster)
        _wait_for(lambda: _both_nodes_idle(env), 30, "both slurmd nodes idle in sinfo", None, cluster)
        yield cluster
    finally:
        for p in reversed(procs):
            stop(p)


def _both_nodes_idle(env: dict[str, str]) -> bool:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=env)
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    return states.get("n1") == "idle" and states.get("n2") == "idle"


def _wait_for(check, timeout: float, what: str, proc: subprocess.Popen | None, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        if check():
            return
        time.sleep(0.2)
    pytest.fail(f"Slurm test cluster: {what} not reached within {timeout}s\n{cluster.log_tail()}")

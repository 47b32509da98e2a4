"""Slurm: read the allocation dsrun runs in, and start one agent per node with srun.

`--launcher slurm` is meant for `salloc`/`sbatch`: the nodes come from
SLURM_JOB_NODELIST (expanded), so no hostfile and no SSH is involved. Each
node's agent runs as its own one-task job step::

    srun --kill-on-bad-exit=1 --nodes=1 --ntasks=1 --ntasks-per-node=1
         --nodelist=NODE --cpus-per-task=C [--gpus-per-task=G] --chdir=CWD
         PYTHON -m dsrun.launcher.agent

[Note: one step per node]
One step per node (instead of one srun over all nodes) lets every agent get
its own job description on its stdin, exactly as over SSH, and keeps that
stdin open for the whole job: when dsrun dies, srun's stdin forwarding
ends, the agent sees EOF and kills its ranks. Each step asks for all CPUs
(and GPUs) Slurm gave the job on that node, so ranks are not confined to one
CPU by task/cgroup. Job-wide fail-fast is the head's: the first failing
rank on any node stops every step. The batch job fails because dsrun exits
non-zero.

A rank started directly by srun (one task per rank, no dsrun) finds its rank
in SLURM_PROCID / SLURM_LOCALID / SLURM_STEP_NUM_TASKS; see `slurm_task_env`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from dsrun.launcher.head import AgentHandle, Runner
from dsrun.launcher.hostfile import HostfileError, expand_host_pattern
from dsrun.launcher.job import NodeJob
from dsrun.launcher.local import start_popen_agent
from dsrun.launcher.placement import derived_port


class SlurmError(RuntimeError):
    """dsrun is not inside a usable Slurm allocation; the message says what is missing."""


def split_nodelist(nodelist: str) -> list[str]:
    """Split a Slurm node list at the commas outside brackets: 'a[1-2],b' -> ['a[1-2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    parts.append(nodelist[start:])
    return [p.strip() for p in parts if p.strip()]


def expand_nodelist(nodelist: str, use_scontrol: bool = True) -> list[str]:
    """Host names of a Slurm node list (`node[01-03,07],gpu1`), in order.

    Uses `scontrol show hostnames` when it is installed (Slurm's own
    parser), else dsrun's (same grammar as hostfile ranges).

    Raises:
        SlurmError: the list is malformed (the message shows where).
    """
    scontrol = shutil.which("scontrol") if use_scontrol else None
    if scontrol:
        proc = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.split()
    names: list[str] = []
    col = 1
    try:
        for part in split_nodelist(nodelist):
            names += expand_host_pattern(part, "SLURM_JOB_NODELIST", 1, nodelist.index(part, col - 1) + 1)
            col += len(part) + 1
    except HostfileError as exc:
        raise SlurmError(f"cannot expand node list {nodelist!r}: {exc}") from exc
    return names


def node_address(name: str) -> str:
    """The address Slurm itself uses for node `name` (its NodeAddr), else `name`.

    NodeAddr defaults to the node name on most clusters, but where it differs
    (nodes named apart from their hosts) it is the address known to work
    between nodes, so it is the better rendezvous address.
    """
    scontrol = shutil.which("scontrol")
    if scontrol:
        proc = subprocess.run([scontrol, "show", "node", "-o", name], capture_output=True, text=True, timeout=30)
        m = re.search(r"\bNodeAddr=(\S+)", proc.stdout)
        if proc.returncode == 0 and m:
            return m.group(1)
    return name


# sinfo's long state names of a node no new step should start on; a trailing '*' (not responding) counts too.
_UNUSABLE_STATES = frozenset({"down", "drain", "drained", "draining", "fail", "failing", "maint", "powered_down",
                              "powering_down", "reboot_issued", "reboot_requested"})


def unusable_nodes(nodes: list[str]) -> dict[str, str]:
    """The nodes of `nodes` Slurm reports failed or taken out of service, with their state.

    [Note: a failed node inside an allocation]
    A node that stops responding (state ending in '*'), goes down, or is
    drained (by an admin or a HealthCheckProgram) while the job holds it is
    left out of the next launch: dsrun starts one step per node by name
    (`--nodelist=NODE`, see [Note: one step per node]), so leaving the node
    out of the node list is srun's `--exclude` for it. That keeps a restart
    inside the same allocation (`--max_restarts`, or a rerun of dsrun in
    the batch script) off the node; the job survives the node's failure
    only if it was submitted with `--no-kill` (Slurm otherwise ends the
    whole job). `dsrun --exclude NODE` leaves a node out by hand.

    Returns {} when `sinfo` is not installed or does not answer (nothing
    known to be wrong).
    """
    sinfo = shutil.which("sinfo")
    if sinfo is None or not nodes:
        return {}
    try:
        proc = subprocess.run([sinfo, "-h", "-N", "-o", "%N %T", "--nodes", ",".join(nodes)], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return {}
    states: dict[str, str] = {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        name, _, state = line.strip().partition(" ")
        if name in nodes and (state.endswith("*") or state.rstrip("*~#!%$@^-").lower() in _UNUSABLE_STATES):
            states[name] = state
    return states


def per_node_counts(value: str, nnodes: int) -> list[int]:
    """Expand Slurm's compressed per-node counts: '4(x2),2' -> [4, 4, 2].

    Raises:
        SlurmError: malformed, or not one count per node.
    """
    counts: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise SlurmError(f"cannot read per-node count {value!r} (expected e.g. '4(x2),2')")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if len(counts) == 1:
        counts *= nnodes
    if len(counts) != nnodes:
        raise SlurmError(f"per-node count {value!r} gives {len(counts)} values for {nnodes} node(s)")
    return counts


@dataclass(frozen=True)
class SlurmAllocation:
    """The part of a Slurm allocation dsrun uses.

    Attributes:
        job_id: SLURM_JOB_ID.
        nodes: host names, in node-rank order.
        tasks_per_node: SLURM_NTASKS_PER_NODE per node, if the user asked for tasks.
        cpus_per_node: CPUs allocated on each node (SLURM_JOB_CPUS_PER_NODE).
        gpus_per_node: GPUs per node (SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE), 0 if none.
    """

    job_id: str
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...] | None
    cpus_per_node: tuple[int, ...]
    gpus_per_node: int

    def ranks_per_node(self, num_procs: int | None) -> list[int]:
        """Ranks on each node: --num_procs, else the tasks asked for, else one per GPU, else 1."""
        if num_procs is not None:
            return [num_procs] * len(self.nodes)
        if self.tasks_per_node is not None:
            return list(self.tasks_per_node)
        return [self.gpus_per_node or 1] * len(self.nodes)

    def default_port(self) -> int:
        """The rendezvous port derived from the Slurm job id (see `derived_port`)."""
        return derived_port(self.job_id)


def allocation_from_env(environ: Mapping[str, str]) -> SlurmAllocation:
    """Read the allocation from the variables salloc/sbatch set.

    Raises:
        SlurmError: not inside an allocation, or the variables disagree.
    """
    job_id = environ.get("SLURM_JOB_ID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        raise SlurmError("--launcher slurm must run inside a Slurm allocation (salloc or an sbatch script): "
                         "SLURM_JOB_ID / SLURM_JOB_NODELIST are not set; use `dsrun sbatch` to write a batch script")
    nodes = expand_nodelist(nodelist)
    nnodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or len(nodes))
    if nnodes != len(nodes):
        raise SlurmError(f"SLURM_NNODES={nnodes} but SLURM_JOB_NODELIST={nodelist!r} expands to {len(nodes)} node(s)")
    tasks = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    cpus = environ.get("SLURM_JOB_CPUS_PER_NODE")
    gpus = environ.get("SLURM_GPUS_ON_NODE") or environ.get("SLURM_GPUS_PER_NODE") or "0"
    gpus_match = re.search(r"(\d+)$", gpus)  # SLURM_GPUS_PER_NODE may read 'a100:4'
    return SlurmAllocation(
        job_id=job_id,
        nodes=tuple(nodes),
        tasks_per_node=tuple(per_node_counts(tasks, nnodes)) if tasks else None,
        cpus_per_node=tuple(per_node_counts(cpus, nnodes)) if cpus else (1,) * nnodes,
        gpus_per_node=int(gpus_match.group(1)) if gpus_match else 0,
    )


def srun_agent_argv(job: NodeJob, alloc: SlurmAllocation, python: str, launcher_args: list[str] = ()) -> list[str]:
    """The srun command that runs `job`'s agent on its node (see [Note: one step per node]).

    `launcher_args` (`--launcher_args`, split) come after dsrun's options, so
    srun lets them override those (e.g. --cpus-per-task).
    """
    cpus = alloc.cpus_per_node[alloc.nodes.index(job.host)]
    argv = ["srun", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
            f"--nodelist={job.host}", f"--cpus-per-task={cpus}", f"--chdir={job.cwd}",
            f"--job-name=dsrun-agent-{job.node_rank}"]
    if alloc.gpus_per_node:
        argv.append(f"--gpus-per-task={alloc.gpus_per_node}")
    return [*argv, *launcher_args, python, "-m", "dsrun.launcher.agent"]


class SlurmRunner(Runner):
    """Starts each node's agent as a one-task srun step inside the current allocation."""

    def __init__(self, alloc: SlurmAllocation, python: str, launcher_args: list[str] = ()) -> None:
        if shutil.which("srun") is None:
            raise SlurmError("srun is not on PATH; --launcher slurm needs Slurm's client commands")
        self.alloc = alloc
        self.python = python
        self.launcher_args = list(launcher_args)

    def start(self, job: NodeJob) -> AgentHandle:
        argv = srun_agent_argv(job, self.alloc, self.python, self.launcher_args)
        return start_popen_agent(job, argv, env=dict(os.environ))


def slurm_task_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Rank variables for a process that srun started as one task per rank.

    Only inside a job step (SLURM_STEP_NUM_TASKS set, which the batch
    script's own shell does not have): there SLURM_PROCID is the rank,
    SLURM_LOCALID the local rank, SLURM_STEP_NUM_TASKS the world size and
    the step's first node the master. MASTER_PORT is derived from the job id
    when unset, the address is the first node's NodeAddr (see
    `node_address`). Returns {} outside a step.
    """
    if "SLURM_STEP_NUM_TASKS" not in environ or "SLURM_PROCID" not in environ:
        return {}
    env = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
    }
    step_nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    tasks = environ.get("SLURM_STEP_TASKS_PER_NODE")
    node_id = int(environ.get("SLURM_NODEID", "0"))
    if tasks:
        counts = per_node_counts(tasks, int(environ.get("SLURM_STEP_NUM_NODES", "1")))
        env["LOCAL_WORLD_SIZE"] = str(counts[node_id])
    if step_nodes and "MASTER_ADDR" not in environ:
        env["MASTER_ADDR"] = node_address(expand_nodelist(step_nodes)[0])
    if "MASTER_PORT" not in environ and "SLURM_JOB_ID" in environ:
        env["MASTER_PORT"] = str(derived_port(environ["SLURM_JOB_ID"]))
    return env

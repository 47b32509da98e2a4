"""The multi-node side of the `dsrun` command: options, placement and the launcher that reaches the nodes.

`cli.py` hands every launch here, a plain `dsrun --num_procs N script.py`
included, so a local launch takes one code path whatever the flags.
Launchers:

    ssh      (default with --hostfile) one agent per node over paramiko, see ssh.py
    slurm    inside salloc/sbatch: one agent per node as an srun step, see slurm.py
    openmpi  mpirun starts the ranks itself, see mpi.py
    mpich    mpiexec (Hydra) starts the ranks itself, see mpi.py
    local    this machine only (the default without --hostfile)

Everything that can be checked is checked before any rank starts: the
hostfile and the filters (with file:line:col), the env files, and for SSH
every connection, host key, login, working directory, Python and the
master address from every node.

Each launcher's module is imported only when that launcher is used, so a
local launch does not pay for paramiko.

`--max_restarts N` (with `--min_nodes`/`--max_nodes`) starts a failed job
again, on the hosts that pass a new pre-check: every launch runs as attempts
through `restart.run_with_restarts` (see [Note: restarts] in restart.py);
without it, the one attempt is the launch as it always was.
"""
from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import click
from rich.console import Console

from dsrun.launcher.env import rank_environment
from dsrun.launcher.failure import exit_status
from dsrun.launcher.head import Head
from dsrun.launcher.hostfile import Host, HostfileError, parse_hostfile, select_slots
from dsrun.launcher.job import DEFAULT_HANG_TIMEOUT, NodeJob, new_job_id
from dsrun.launcher.local_devices import default_num_procs, warn_if_oversubscribed
from dsrun.launcher.ports import DEFAULT_MASTER_PORT
from dsrun.launcher.placement import build_placement, compact_ranges, derived_port, node_jobs, print_placement
from dsrun.launcher.propagate import EnvFileError, masked, propagated_env
from dsrun.launcher.restart import (AttemptResult, HostsDown, NotEnoughHosts, RestartPolicy, attempt_job_id,
                                   run_with_restarts)

LAUNCHERS = ("ssh", "slurm", "openmpi", "mpich", "local")


@dataclass(frozen=True)
class MultinodeOptions:
    """The multi-node options of `dsrun` (see `multinode_options` for their help)."""

    hostfile: Path | None
    include: str
    exclude: str
    num_nodes: int | None
    launcher: str | None
    ssh_config: Path | None
    ssh_host_key_policy: str | None
    ssh_parallelism: int
    remote_python: str | None
    remote_cwd: str | None
    env: tuple[str, ...]
    print_env: bool
    dry_run: bool
    max_restarts: int
    min_nodes: int | None
    max_nodes: int | None
    launcher_args: str = ""
    no_ssh: bool = False
    node_rank: int | None = None
    force_multi: bool = False


_OPTIONS = [
    click.option("--hostfile", "-H", type=click.Path(path_type=Path), default=None,
                 help="Hosts and their slots, one 'HOST slots=N' per line (see hostfile.example)."),
    click.option("--include", "-i", default="", help="Use only these hosts/slots: NAME[:SLOT[,SLOT|A-B]][@NAME...]."),
    click.option("--exclude", "-e", default="", help="Leave out these hosts/slots (same grammar as --include)."),
    click.option("--num_nodes", type=click.IntRange(min=1), default=None, help="Use only the first N hosts."),
    click.option("--launcher", type=click.Choice(LAUNCHERS), default=None,
                 help="How to reach the nodes [default: ssh with --hostfile, else local]."),
    click.option("--ssh_config", type=click.Path(path_type=Path), default=None,
                 help="ssh config file [default: ~/.ssh/config]."),
    click.option("--ssh_host_key_policy", type=click.Choice(["strict", "accept-new"]), default=None,
                 help="Hosts missing from every known_hosts file: refuse (strict) or add them (accept-new) "
                      "[default: StrictHostKeyChecking from the ssh config, else strict]. A changed key is "
                      "always refused."),
    # 32 is ssh.DEFAULT_SSH_PARALLELISM, not imported here: a local launch does not pay for paramiko.
    click.option("--ssh_parallelism", type=click.IntRange(min=1), default=32, show_default=True,
                 help="Hosts connected to, and agents started, at once over SSH; each host that fails is named."),
    click.option("--remote_python", default=None, help="Python on the other nodes [default: this Python's path]."),
    click.option("--remote_cwd", default=None, help="Working directory on the other nodes [default: this one]."),
    click.option("--env", multiple=True, metavar="NAME|K=V",
                 help="NAME: forward this variable's value from dsrun's environment to every rank; K=V: set it "
                      "(repeatable). Use NAME for secrets (--env WANDB_API_KEY): a K=V value is visible to "
                      "every local user in ps."),
    click.option("--print_env", is_flag=True, help="Show the variables each rank gets (propagated values masked)."),
    click.option("--dry_run", is_flag=True, help="Print the placement (and the environment with --print_env) and exit."),
    click.option("--max_restarts", type=click.IntRange(min=0), default=0, show_default=True,
                 help="After a failure, start the job again up to N times, on the hosts that pass a new "
                      "pre-check (ranks see DSRUN_RESTART_COUNT); a stop by Ctrl-C/SIGTERM is never "
                      "restarted (docs/restarts.md)."),
    click.option("--min_nodes", type=click.IntRange(min=1), default=None,
                 help="Fewest hosts an attempt may run on when hosts fail the pre-check "
                      "[default: every host on the first attempt, 1 on a restart]."),
    click.option("--max_nodes", type=click.IntRange(min=1), default=None,
                 help="Most hosts an attempt runs on: the first healthy ones in hostfile order [default: all]."),
    click.option("--launcher_args", default="", metavar="'ARGS'",
                 help="Arguments for mpirun (openmpi), mpiexec (mpich) or each srun (slurm), as one quoted string, "
                      "e.g. --launcher_args '--allow-run-as-root' (DeepSpeed's flag); put them before the program."),
    click.option("--no_ssh", is_flag=True,
                 help="Per-node launch: this node starts only its own ranks and joins the others; run the same "
                      "dsrun command on every node with --node_rank K (or under SkyPilot/Kubeflow, which set it) "
                      "and the same --hostfile (docs/cluster-managers.md)."),
    click.option("--node_rank", type=click.IntRange(min=0), default=None,
                 help="This node's index in the job for a per-node launch (implies --no_ssh) "
                      "[default: SKYPILOT_NODE_RANK or PET_NODE_RANK]."),
    click.option("--force_multi", is_flag=True,
                 help="Use the SSH launcher even when the hostfile's one host is this machine "
                      "(by default such a hostfile runs locally, without SSH)."),
]
_FIELDS = [f.name for f in fields(MultinodeOptions)]


def multinode_options(command):
    """Decorator adding the multi-node options; the command receives them as one `multinode` argument."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        options = MultinodeOptions(**{name: kwargs.pop(name) for name in _FIELDS})
        return command(*args, multinode=options, **kwargs)

    for option in reversed(_OPTIONS):
        wrapper = option(wrapper)
    return wrapper


@dataclass(frozen=True)
class RankCommand:
    """What the local CLI already settled: the rank argv and the per-job knobs."""

    command: list[str]
    num_procs: int | None
    master_addr: str | None
    master_port: int | None
    grace_period: float
    pass_local_rank: bool
    log_dir: str | None
    rendezvous_timeout: float
    hang_timeout: float = DEFAULT_HANG_TIMEOUT


def run_multinode(opts: MultinodeOptions, rc: RankCommand, console: Console) -> int:
    """Place the ranks, check everything, launch with the chosen launcher; returns dsrun's exit status.

    Raises:
        click.UsageError: bad hostfile, filter, env file or option mix (nothing started).
        click.ClickException: the nodes cannot be reached, or fewer than
            --min_nodes can (nothing started).
    """
    launcher = opts.launcher or ("ssh" if opts.hostfile else "local")
    try:
        if opts.no_ssh or opts.node_rank is not None:
            return _run_per_node(opts, rc, console)
        return _run(opts, rc, launcher, console)
    except NotEnoughHosts as exc:
        raise click.ClickException(str(exc)) from exc
    except (HostfileError, EnvFileError, FileNotFoundError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc


def _hosts(opts: MultinodeOptions, launcher: str, num_procs: int | None,
           console: Console) -> tuple[list[Host], int | None]:
    """The candidate hosts, and the --num_procs still to apply per host."""
    if launcher == "slurm":
        from dsrun.launcher.slurm import SlurmError, allocation_from_env, unusable_nodes
        if opts.hostfile:
            raise ValueError("--launcher slurm takes the nodes from the allocation; drop --hostfile")
        try:
            alloc = allocation_from_env(os.environ)
        except SlurmError as exc:
            raise ValueError(str(exc)) from exc
        failed = unusable_nodes(list(alloc.nodes))  # see [Note: a failed node inside an allocation]
        if failed and len(failed) == len(alloc.nodes):
            raise ValueError(f"every node of the allocation is out of service: {failed}")
        for node, state in failed.items():
            console.print(f"dsrun: leaving out node {node}: Slurm reports it {state}")
        return [Host(n, c) for n, c in zip(alloc.nodes, alloc.ranks_per_node(num_procs)) if n not in failed], None
    if opts.hostfile:
        if launcher == "local":
            raise ValueError("--launcher local runs on this machine only; drop --hostfile or use --launcher ssh")
        return parse_hostfile(opts.hostfile), num_procs
    if opts.include or opts.exclude or opts.num_nodes is not None or launcher == "ssh":
        raise ValueError("--include/--exclude/--num_nodes and --launcher ssh need --hostfile")
    if num_procs is None:
        num_procs = default_num_procs(console)
    warn_if_oversubscribed(num_procs, console)
    return [Host("localhost", num_procs)], None


def _run(opts: MultinodeOptions, rc: RankCommand, launcher: str, console: Console) -> int:
    if opts.launcher_args and launcher not in ("openmpi", "mpich", "slurm"):
        raise ValueError(f"--launcher_args goes to mpirun, mpiexec or srun; --launcher {launcher} runs none of "
                         "them (for SSH options use --ssh_config)")
    if opts.force_multi and launcher != "ssh":
        raise ValueError(f"--force_multi makes a one-host hostfile go over SSH; it does nothing with --launcher "
                         f"{launcher}")
    hosts, per_host = _hosts(opts, launcher, rc.num_procs, console)
    selection = select_slots(hosts, opts.include, opts.exclude, opts.num_nodes, per_host)
    placement = build_placement(selection)
    from_hostfile = opts.hostfile is not None
    if launcher == "ssh" and _is_this_machine(placement.hosts, opts.force_multi):
        # See [Note: a one-host hostfile].
        console.print(f"dsrun: the hostfile's one host, {placement.hosts[0]}, is this machine: running its "
                      "ranks here without SSH (--force_multi: over SSH)")
        launcher = "local"
    cwd = opts.remote_cwd or os.getcwd()
    python = opts.remote_python or sys.executable
    command = [python, *rc.command[1:]] if rc.command[0] == sys.executable else rc.command
    env = propagated_env(os.environ, Path(cwd), opts.env)
    job_id = new_job_id()
    master_addr = rc.master_addr or placement.hosts[0]
    port = rc.master_port or DEFAULT_MASTER_PORT
    # Local ranks inherit this process's environment (CUDA_VISIBLE_DEVICES included) through the agent.
    inherited: dict[str, str] = {}
    if launcher == "local":
        master_addr, port = _local_rendezvous(rc, job_id, console)
        inherited = dict(os.environ)

    def jobs_for(addr: str, port: int, hosts: list[str] | None = None, restart: int = 0) -> list[NodeJob]:
        """The node jobs on `hosts` (a subset of the placement's, default all) for restart `restart`."""
        chosen = placement if hosts is None else build_placement({h: selection[h] for h in hosts})
        return node_jobs(chosen, job_id=attempt_job_id(job_id, restart), master_addr=addr, master_port=port,
                         command=command, cwd=cwd, env=env, grace_period=rc.grace_period,
                         pass_local_rank=rc.pass_local_rank, log_dir=rc.log_dir,
                         visible_devices=launcher == "ssh" or (launcher == "local" and from_hostfile),
                         rendezvous_timeout=rc.rendezvous_timeout, hang_timeout=rc.hang_timeout,
                         restart_count=restart)

    if opts.dry_run:
        print_placement(placement, console, master_addr)
        if opts.print_env:
            print_environment(jobs_for(master_addr, port), console, inherited)
        return 0
    policy = RestartPolicy(opts.max_restarts, opts.min_nodes, opts.max_nodes)
    if launcher in ("openmpi", "mpich"):
        if policy != RestartPolicy():
            raise ValueError(f"--max_restarts/--min_nodes/--max_nodes need a launcher dsrun's head runs "
                             f"(ssh, slurm, local); --launcher {launcher} hands the ranks to mpirun")
        return _run_mpi(launcher, placement, command, env, master_addr, rc.master_port or derived_port(job_id), opts, console)
    if launcher == "local":
        attempt = _local_attempt(jobs_for, inherited, master_addr, port, opts, console)
        return run_with_restarts(policy, placement.hosts, attempt, console)
    if launcher == "slurm":
        from dsrun.launcher.slurm import SlurmRunner, allocation_from_env, node_address
        alloc = allocation_from_env(os.environ)
        runner = SlurmRunner(alloc, python, shlex.split(opts.launcher_args))

        def slurm_attempt(restart: int, hosts: list[str], header: str | None) -> AttemptResult:
            # The allocation's nodes are the job's: no pre-check, no host dropped.
            jobs = jobs_for(rc.master_addr or node_address(hosts[0]), rc.master_port or alloc.default_port(),
                            hosts, restart)
            return _run_head(jobs, runner, opts, console, header=header)

        return run_with_restarts(policy, placement.hosts, slurm_attempt, console)
    from dsrun.launcher.ssh import HostKeyPolicy, SshConnectError, prepare_ssh_launch
    key_policy = HostKeyPolicy(opts.ssh_host_key_policy) if opts.ssh_host_key_policy else None

    def ssh_attempt(restart: int, hosts: list[str], header: str | None) -> AttemptResult:
        try:
            launch = prepare_ssh_launch(hosts, ssh_config=opts.ssh_config, policy=key_policy, python=python,
                                        cwd=cwd, job_id=attempt_job_id(job_id, restart),
                                        master_addr=rc.master_addr, master_port=rc.master_port,
                                        parallelism=opts.ssh_parallelism)
        except SshConnectError as exc:  # the pre-check: nothing was started
            raise HostsDown(exc.failures, original=exc) from exc
        for note in launch.notes:
            console.print(f"dsrun: {note}")
        try:
            return _run_head(jobs_for(launch.master_addr, launch.master_port, hosts, restart), launch.runner,
                             opts, console, header=header)
        finally:
            launch.runner.close()

    try:
        return run_with_restarts(policy, placement.hosts, ssh_attempt, console)
    except SshConnectError as exc:
        console.print(exc.table())
        raise click.ClickException(f"{exc.stage} failed on {', '.join(exc.failures)}; nothing was started") from exc


def _is_this_machine(hosts: list[str], force_multi: bool) -> bool:
    """True for one host that is this machine, unless --force_multi (see [Note: a one-host hostfile]).

    [Note: a one-host hostfile]
    A hostfile with one host, this machine (localhost, 127.0.0.1, its name
    or one of its addresses), as SkyPilot's recipe writes on a one-node
    cluster, runs its ranks here as a local launch: no sshd is needed (a
    container often has none). DeepSpeed 0.19's runner starts the ranks of
    any one-host hostfile locally, even one naming another machine, but
    first runs `ssh HOST hostname` (unless --no_ssh_check) and asks the host
    for its address over SSH (unless --master_addr), so it too fails without
    sshd; dsrun needs no SSH here, and goes over SSH for a one-host
    hostfile naming another machine, since the ranks belong there.
    `--force_multi` goes over SSH in both cases, as DeepSpeed's does. The hostfile's slot selection still
    applies (CUDA_VISIBLE_DEVICES lists the chosen slots).
    """
    from dsrun.launcher.ports import is_local_address
    return len(hosts) == 1 and not force_multi and is_local_address(hosts[0])


def _run_per_node(opts: MultinodeOptions, rc: RankCommand, console: Console) -> int:
    """This node's part of a per-node launch (see [Note: per-node launch] in pernode.py)."""
    from dsrun.launcher.local import LocalRunner
    from dsrun.launcher.pernode import nodes_from_environment, per_node_launch
    if opts.launcher not in (None, "local", "ssh") or opts.launcher_args or opts.force_multi:
        raise ValueError("--no_ssh/--node_rank start this node's ranks here; drop --launcher "
                         f"{opts.launcher or ''}/--launcher_args/--force_multi")
    if RestartPolicy(opts.max_restarts, opts.min_nodes, opts.max_nodes) != RestartPolicy():
        raise ValueError("--max_restarts/--min_nodes/--max_nodes need dsrun to start every node; with --no_ssh "
                         "each node's dsrun sees only its own ranks (restart the job from the cluster manager)")
    if opts.hostfile:
        hosts, source = parse_hostfile(opts.hostfile), str(opts.hostfile)
        per_host = rc.num_procs
    else:
        hosts, source = nodes_from_environment(os.environ, rc.num_procs, lambda: default_num_procs(console))
        per_host = None
    launch = per_node_launch(os.environ, hosts, source, opts.node_rank, rc.master_addr, rc.master_port)
    selection = select_slots(hosts, opts.include, opts.exclude, opts.num_nodes, per_host)
    placement = build_placement(selection)
    if launch.node_rank >= len(placement.nodes):
        raise ValueError(f"node rank {launch.node_rank} is out of range: the selection keeps "
                         f"{len(placement.nodes)} node(s) of {source}")
    cwd = os.getcwd()
    job = node_jobs(placement, job_id=new_job_id(), master_addr=launch.master_addr, master_port=launch.master_port,
                    command=rc.command, cwd=cwd, env=propagated_env(os.environ, Path(cwd), opts.env),
                    grace_period=rc.grace_period, pass_local_rank=rc.pass_local_rank, log_dir=rc.log_dir,
                    visible_devices=opts.hostfile is not None, rendezvous_timeout=rc.rendezvous_timeout,
                    hang_timeout=rc.hang_timeout)[launch.node_rank]
    console.print(f"dsrun: per-node launch from {source}: node {job.node_rank} of {job.nnodes} ({job.host}) starts "
                  f"ranks {compact_ranges(job.ranks)} of {job.world_size}")
    if opts.dry_run:
        print_placement(placement, console, launch.master_addr)
        if opts.print_env:
            print_environment([job], console, dict(os.environ))
        return 0
    return _run_head([job], LocalRunner(), opts, console, dict(os.environ)).status


def _local_attempt(jobs_for, inherited: dict[str, str], addr: str, port: int, opts: MultinodeOptions,
                   console: Console):
    """The launch callback of a local launch (see restart.run_with_restarts).

    A restart reuses the first attempt's port, free again once its ranks
    exited; if another process took it meanwhile, a free port is picked
    and a line says so.
    """
    from dsrun.launcher.local import LocalRunner
    from dsrun.launcher.ports import free_port, port_is_free

    def attempt(restart: int, hosts: list[str], header: str | None) -> AttemptResult:
        nonlocal port
        if restart and not port_is_free(port):
            previous, port = port, free_port()
            console.print(f"dsrun: port {previous} is taken since the last attempt; using MASTER_PORT={port}")
        return _run_head(jobs_for(addr, port, hosts, restart), LocalRunner(), opts, console, inherited,
                         header=header)

    return attempt


def _local_rendezvous(rc: RankCommand, job_id: str, console: Console) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT of a one-node launch: the address must be this machine's.

    Raises:
        ValueError: --master_addr names another machine (rank 0 runs here, so
            the ranks would wait for a rendezvous that never opens).
        PortError: --master_port is busy here.
    """
    from dsrun.launcher.ports import choose_master_port, is_local_address
    addr = rc.master_addr or "127.0.0.1"
    if not is_local_address(addr):
        raise ValueError(f"--master_addr {addr} is not an address of this machine, but every rank of this "
                         "launch runs here, rank 0's rendezvous included; leave --master_addr out "
                         "(127.0.0.1) or give one of this machine's addresses")
    port, notice = choose_master_port(addr, rc.master_port, job_id)
    if notice:
        console.print(f"dsrun: {notice}")
    return addr, port


def _run_head(jobs: list[NodeJob], runner, opts: MultinodeOptions, console: Console,
              inherited: dict[str, str] | None = None, header: str | None = None) -> AttemptResult:
    """Run one attempt of the job through the head; `header` (a restart's line) is printed first."""
    if header:
        console.print(header, soft_wrap=True)
    if opts.print_env:
        print_environment(jobs, console, inherited)
    console.print(f"dsrun: job {jobs[0].job_id}: {jobs[0].world_size} rank(s) on {len(jobs)} node(s), "
                  f"master {jobs[0].master_addr}:{jobs[0].master_port}")
    head = Head(jobs, runner, console)
    status = head.run()
    return AttemptResult(status, head.stopped_by, head.first_failure())


def _run_mpi(flavor: str, placement, command: list[str], env: dict[str, str], master_addr: str, port: int,
             opts: MultinodeOptions, console: Console) -> int:
    from dsrun.launcher.mpi import mpirun_command, mpirun_env
    argv = mpirun_command(flavor, placement, command, list(env), shlex.split(opts.launcher_args))
    if opts.print_env:
        console.print("dsrun: forwarded by name to every rank: " + ", ".join(masked(env)))
    console.print("dsrun: " + " ".join(argv))  # names only: no value is on this line
    try:
        proc = subprocess.run(argv, env=mpirun_env(os.environ, env, master_addr, port))
    except FileNotFoundError as exc:
        raise click.ClickException(f"{argv[0]} is not on PATH; install {flavor} or pick another --launcher") from exc
    return exit_status(proc.returncode)


def print_environment(jobs: list[NodeJob], console: Console, inherited: dict[str, str] | None = None) -> None:
    """Show what each rank gets: dsrun's rank variables in clear, propagated values masked.

    `inherited` is the environment the agent passes on to its ranks when it
    is known here (a local launch: this process's); CUDA_VISIBLE_DEVICES is
    shown from the job, else from there, as the ranks will see it.
    """
    console.print("dsrun: environment of each rank (propagated values masked):")
    for job in jobs:
        devices = job.env.get("CUDA_VISIBLE_DEVICES", (inherited or {}).get("CUDA_VISIBLE_DEVICES"))
        own = {"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {}
        shared = {k: v for k, v in job.env.items() if k not in own}
        console.print(f"  node {job.node_rank} ({job.host}): " + " ".join(masked(shared)), soft_wrap=True)
        for index, rank in enumerate(job.ranks):
            contract = {**own, **rank_environment(job, index)}
            console.print(f"    rank {rank}: " + " ".join(f"{k}={v}" for k, v in contract.items()), soft_wrap=True)

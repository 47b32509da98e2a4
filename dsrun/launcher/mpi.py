"""MPI launchers (`--launcher openmpi|mpich`) and rank discovery from schedulers.

With an MPI launcher, mpirun/mpiexec starts every rank itself (there is no
dsrun agent). Each rank runs `python -m dsrun.launcher.mpi COMMAND...`,
which turns the launcher's variables into the standard rank variables
(`rank_env_from_scheduler`) and then execs COMMAND, so training scripts see
RANK, LOCAL_RANK, WORLD_SIZE, ... as under dsrun or torchrun.

Propagated variables are passed by *name* (`-x NAME` for Open MPI,
`-genvlist` for MPICH/Hydra): mpirun reads their values from its own
environment, so no value is written on a command line.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from dsrun.launcher.placement import Placement
from dsrun.launcher.slurm import slurm_task_env


class SchedulerEnvError(RuntimeError):
    """A launcher's rank variables are incomplete; the message names what is missing."""


def mpirun_command(flavor: str, placement: Placement, command: list[str], env_names: list[str]) -> list[str]:
    """The mpirun (Open MPI) or mpiexec (MPICH/Hydra) argv for `placement`.

    Args:
        flavor: "openmpi" or "mpich".
        command: every rank's argv (python, script, args).
        env_names: variables to forward by name (their values stay in the
            environment of the mpirun process, see `mpirun_env`);
            MASTER_ADDR and MASTER_PORT are always forwarded.

    Raises:
        ValueError: unknown flavor.
    """
    hosts = ",".join(f"{n.host}:{n.local_world_size}" for n in placement.nodes)
    rank_cmd = [sys.executable, "-m", "dsrun.launcher.mpi", *command]
    names = sorted({*env_names, "MASTER_ADDR", "MASTER_PORT"})
    if flavor == "openmpi":
        argv = ["mpirun", "-n", str(placement.world_size), "--host", hosts, "--map-by", "slot", "--bind-to", "none"]
        for name in names:
            argv += ["-x", name]
        return [*argv, *rank_cmd]
    if flavor == "mpich":
        return ["mpiexec", "-n", str(placement.world_size), "-hosts", hosts, "-genvlist", ",".join(names), *rank_cmd]
    raise ValueError(f"unknown MPI flavor {flavor!r}; use openmpi or mpich")


def mpirun_env(base: Mapping[str, str], propagated: Mapping[str, str], master_addr: str, master_port: int) -> dict[str, str]:
    """The environment of the mpirun process: the values that `-x NAME` / `-genvlist` forward."""
    return {**base, **propagated, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    return next((environ[n] for n in names if n in environ), None)


def mpi_rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Rank variables from Open MPI (OMPI_COMM_WORLD_*), MPICH/Hydra (PMI_*, MPI_LOCAL*) or PMIx (PMIX_RANK).

    Returns {} when none of them is set.

    Raises:
        SchedulerEnvError: a rank is set but the world size is not known.
    """
    rank = _first(environ, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    if rank is None:
        return {}
    size = _first(environ, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")
    if size is None:
        raise SchedulerEnvError(f"MPI rank {rank} is set but no world size (OMPI_COMM_WORLD_SIZE, PMI_SIZE or "
                                "SLURM_STEP_NUM_TASKS); set WORLD_SIZE yourself")
    env = {"RANK": rank, "WORLD_SIZE": size}
    local = _first(environ, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
    local_size = _first(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    if local is not None:
        env["LOCAL_RANK"] = local
    if local_size is not None:
        env["LOCAL_WORLD_SIZE"] = env["LOCAL_SIZE"] = local_size
    return env


def rank_env_from_scheduler(environ: Mapping[str, str]) -> dict[str, str]:
    """Standard rank variables for a process started by mpirun, mpiexec or srun (one task per rank).

    Returns {} when RANK is already set (dsrun, torchrun) or no launcher's
    variables are present. MPI variables win over Slurm's: under mpirun in a
    Slurm allocation, SLURM_PROCID numbers the MPI daemons, not the ranks.
    Variables already in `environ` are never overridden.

    Raises:
        SchedulerEnvError: see `mpi_rank_env`.
    """
    if "RANK" in environ:
        return {}
    found = mpi_rank_env(environ) or slurm_task_env(environ)
    return {k: v for k, v in found.items() if k not in environ}


def main(argv: list[str]) -> None:
    """`python -m dsrun.launcher.mpi COMMAND...`: set the rank variables, then exec COMMAND."""
    if not argv:
        sys.exit("usage: python -m dsrun.launcher.mpi COMMAND [ARGS...] (run by mpirun/mpiexec for each rank)")
    try:
        env = {**os.environ, **rank_env_from_scheduler(os.environ)}
    except SchedulerEnvError as exc:
        sys.exit(f"dsrun: {exc}")
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main(sys.argv[1:])

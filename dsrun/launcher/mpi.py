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


def mpirun_command(flavor: str, placement: Placement, command: list[str], env_names: list[str],
                   launcher_args: list[str] = ()) -> list[str]:
    """The mpirun (Open MPI) or mpiexec (MPICH/Hydra) argv for `placement`.

    Args:
        flavor: "openmpi" or "mpich".
        command: every rank's argv (python, script, args).
        env_names: variables to forward by name (their values stay in the
            environment of the mpirun process, see `mpirun_env`);
            MASTER_ADDR and MASTER_PORT are always forwarded.
        launcher_args: `--launcher_args`, split; placed after dsrun's own
            options and before the program, as DeepSpeed's runner does.

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
        return [*argv, *launcher_args, *rank_cmd]
    if flavor == "mpich":
        return ["mpiexec", "-n", str(placement.world_size), "-hosts", hosts, "-genvlist", ",".join(names),
                *launcher_args, *rank_cmd]
    raise ValueError(f"unknown MPI flavor {flavor!r}; use openmpi or mpich")


def mpirun_env(base: Mapping[str, str], propagated: Mapping[str, str], master_addr: str, master_port: int) -> dict[str, str]:
    """The environment of the mpirun process: the values that `-x NAME` / `-genvlist` forward."""
    return {**base, **propagated, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """(name, value) of the first of `names` set in `environ`."""
    return next(((n, environ[n]) for n in names if n in environ), None)


def check_rank_and_size(rank: tuple[str, str], size: tuple[str, str]) -> None:
    """Refuse a launcher's (name, value) rank and world size that cannot describe one rank of a job.

    [Note: incomplete scheduler environment]
    A rank that reads its rank but not the job's size, or a size of 1 beside
    a rank above 0, would run as a job of its own: N one-rank jobs that each
    train alone and write the same checkpoints, with no error anywhere. So
    such an environment is an error naming the variables, before anything
    starts.

    Raises:
        SchedulerEnvError: a value is not a whole number, or not 0 <= rank < size.
    """
    (rank_name, rank_text), (size_name, size_text) = rank, size
    if not rank_text.strip().isdigit() or not size_text.strip().isdigit():
        raise SchedulerEnvError(f"{rank_name}={rank_text!r} {size_name}={size_text!r}: both must be whole numbers")
    if not 0 <= int(rank_text) < int(size_text):
        raise SchedulerEnvError(
            f"{rank_name}={rank_text} but {size_name}={size_text}: a rank must be below the world size; the "
            "launcher's environment is incomplete or mixed from two jobs (see [Note: incomplete scheduler "
            "environment] in dsrun/launcher/mpi.py); set RANK and WORLD_SIZE yourself or start the ranks with "
            "mpirun/srun/dsrun")


def mpi_rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Rank variables from Open MPI (OMPI_COMM_WORLD_*), MPICH/Hydra (PMI_*, MPI_LOCAL*) or PMIx (PMIX_RANK).

    Returns {} when none of them is set.

    Raises:
        SchedulerEnvError: a rank is set but the world size is not known, or
            they disagree (see `check_rank_and_size`).
    """
    rank = _first(environ, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    if rank is None:
        return {}
    size = _first(environ, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")
    if size is None:
        raise SchedulerEnvError(f"{rank[0]}={rank[1]} is set but no world size (OMPI_COMM_WORLD_SIZE, PMI_SIZE "
                                "or SLURM_STEP_NUM_TASKS); set WORLD_SIZE yourself, or unset "
                                f"{rank[0]} to run as a single process")
    check_rank_and_size(rank, size)
    env = {"RANK": rank[1], "WORLD_SIZE": size[1]}
    local = _first(environ, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
    local_size = _first(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    if local is not None:
        env["LOCAL_RANK"] = local[1]
    if local_size is not None:
        env["LOCAL_WORLD_SIZE"] = env["LOCAL_SIZE"] = local_size[1]
    return env


def _srun_started(environ: Mapping[str, str]) -> bool:
    """True when srun itself started this MPI rank (srun --mpi=pmix): one step task per rank.

    Not under mpirun/mpiexec inside an allocation: they start their daemons
    as a step of their own (SLURM_PROCID numbers the daemons, and the step
    leaves out mpirun's node), so its first node need not be rank 0's.
    Those set OMPI_COMM_WORLD_RANK or PMI_RANK; srun sets only PMIX_RANK,
    equal to SLURM_PROCID, with SLURM_STEP_NUM_TASKS ranks.
    """
    return ("OMPI_COMM_WORLD_RANK" not in environ and "PMI_RANK" not in environ
            and environ.get("PMIX_RANK") == environ.get("SLURM_PROCID")
            and "SLURM_STEP_NUM_TASKS" in environ)


def _slurm_rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`slurm_task_env`, refusing a Slurm task whose world size is missing or too small.

    The batch script's own shell has SLURM_PROCID=0 and no step variables:
    it is one process, not a rank. A SLURM_PROCID above 0 without
    SLURM_STEP_NUM_TASKS is a task of some step whose size is unknown, and
    an error (see [Note: incomplete scheduler environment]).
    """
    found = slurm_task_env(environ)
    if found:
        check_rank_and_size(("SLURM_PROCID", environ["SLURM_PROCID"]),
                            ("SLURM_STEP_NUM_TASKS", environ["SLURM_STEP_NUM_TASKS"]))
    elif environ.get("SLURM_PROCID", "0").strip() not in ("", "0"):
        raise SchedulerEnvError(
            f"SLURM_PROCID={environ['SLURM_PROCID']} is set but SLURM_STEP_NUM_TASKS is not, so the world size "
            "is unknown and this task would train alone; start the ranks with srun (which sets it) or set "
            "RANK and WORLD_SIZE yourself")
    return found


def rank_env_from_scheduler(environ: Mapping[str, str]) -> dict[str, str]:
    """Standard rank variables for a process started by mpirun, mpiexec or srun (one task per rank).

    Returns {} when RANK is already set (dsrun, torchrun) or no launcher's
    variables are present. MPI variables win over Slurm's: under mpirun in a
    Slurm allocation, SLURM_PROCID numbers the MPI daemons, not the ranks;
    inside a Slurm step (srun --mpi=pmix) the master address and port still
    come from the step (see `slurm_task_env`).
    Variables already in `environ` are never overridden.

    Raises:
        SchedulerEnvError: see `mpi_rank_env` and `slurm_task_env`.
    """
    if "RANK" in environ:
        return {}
    found = mpi_rank_env(environ)
    if found and _srun_started(environ):
        # srun --mpi=pmix sets PMIX_RANK; Slurm still knows rank 0's node (the step's first) and the port.
        step = slurm_task_env(environ)
        found.update({k: v for k, v in step.items() if k in ("MASTER_ADDR", "MASTER_PORT")})
    found = found or _slurm_rank_env(environ)
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

"""What each rank process gets: its environment variables and its argv.

[Note: rank environment contract]
Every rank gets both torchrun's and DeepSpeed's names for the same facts,
so a script written for either launcher runs unchanged:

    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT     both launchers
    LOCAL_RANK                                     both launchers
    LOCAL_WORLD_SIZE, GROUP_RANK                   torchrun
    LOCAL_SIZE, CROSS_RANK, CROSS_SIZE             DeepSpeed (and Horovod)
    NODE_RANK                                      common in Lightning-style scripts
    DSRUN_JOB_ID                                   dsrun: unique id of the job
    DSRUN_RENDEZVOUS_TIMEOUT                       dsrun: seconds ranks wait for each other at start
    DSRUN_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT  restarts before this attempt (0 on the first run;
                                                   dsrun --max_restarts, see dsrun/launcher/restart.py)
    PYTHONUNBUFFERED=1                             output reaches the launcher line by line
    DSRUN_PROGRESS=1                               rank 0's engine sends progress records (progress.py)
    PYTHONWARNINGS (only where NumPy is missing)   hides torch's import-time "Failed to initialize NumPy"
                                                   (see [Note: torch's NumPy warning] in dsrun/numpy_warning.py)

The runtime reads only RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT (and LOCAL_WORLD_SIZE), so it also runs under torchrun.
CROSS_RANK/CROSS_SIZE are the node index and node count, which is what they
mean when every node runs the same number of ranks.
"""
from __future__ import annotations

from dsrun.env import PROGRESS
from dsrun.launcher.job import NodeJob
from dsrun.numpy_warning import rank_warning_filter


def rank_environment(job: NodeJob, index: int) -> dict[str, str]:
    """The contract variables for the `index`-th rank of `job` (see [Note: rank environment contract]).

    Raises IndexError if `index` is not a position in `job.ranks`.
    """
    local_world = str(len(job.ranks))
    return {
        "RANK": str(job.ranks[index]),
        "LOCAL_RANK": str(job.local_ranks[index]),
        "WORLD_SIZE": str(job.world_size),
        "LOCAL_WORLD_SIZE": local_world,
        "LOCAL_SIZE": local_world,
        "NODE_RANK": str(job.node_rank),
        "GROUP_RANK": str(job.node_rank),
        "CROSS_RANK": str(job.node_rank),
        "CROSS_SIZE": str(job.nnodes),
        "MASTER_ADDR": job.master_addr,
        "MASTER_PORT": str(job.master_port),
        "DSRUN_JOB_ID": job.job_id,
        "DSRUN_RENDEZVOUS_TIMEOUT": f"{job.rendezvous_timeout:g}",
        "DSRUN_RESTART_COUNT": str(job.restart_count),
        "TORCHELASTIC_RESTART_COUNT": str(job.restart_count),
        "PYTHONUNBUFFERED": "1",
        PROGRESS.name: "1",  # not via launcher/progress.py: the agent does not import rich
    }


def rank_process_env(job: NodeJob, index: int, base: dict[str, str]) -> dict[str, str]:
    """The full environment of a rank: `base` (the agent's own), then `job.env`, then the contract.

    The contract variables win over anything inherited, so a stale RANK in the
    user's shell cannot leak into a rank. Where NumPy is not installed,
    PYTHONWARNINGS gets one more filter in front of the user's (see
    [Note: torch's NumPy warning] in dsrun/numpy_warning.py).
    """
    env = {**base, **job.env, **rank_environment(job, index)}
    return {**env, **rank_warning_filter(env)}


def rank_argv(job: NodeJob, index: int) -> list[str]:
    """The argv of the `index`-th rank: the job command, plus ``--local_rank=N`` if asked for."""
    if job.pass_local_rank:
        return [*job.command, f"--local_rank={job.local_ranks[index]}"]
    return list(job.command)

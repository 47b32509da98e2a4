"""The per-node job description that the head hands to each node's agent.

A `NodeJob` is everything an agent needs to start and watch the ranks of
one node: which global ranks it runs, where the rendezvous is, the rank
command, and how to tear down. It travels as one JSON line (on the agent's
stdin, locally or over an SSH channel), so it holds only plain data.
"""
from __future__ import annotations

import os
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Seconds the ranks of a dsrun job wait for each other at start-up (see dsrun.runtime.distributed.rendezvous).
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0
# Seconds without a heartbeat after which a rank is reported hung (see [Note: hung ranks] in hang.py).
DEFAULT_HANG_TIMEOUT = 600.0


def new_job_id() -> str:
    """A job id unique across hosts and time, e.g. ``dsrun-20240501-120000-1a2b3c4d``.

    It is exported to every rank as DSRUN_JOB_ID, which also lets tools find
    every process of a job (each rank carries it in its environment).
    """
    return f"dsrun-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


class NodeJob(BaseModel):
    """What one node's agent runs: its ranks, the rendezvous and the command.

    Raises pydantic.ValidationError when the fields contradict each other
    (rank lists of different lengths, a rank outside the world, a node rank
    outside the node count).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(description="Unique id of the whole job; exported as DSRUN_JOB_ID.")
    host: str = Field("localhost", description="Name of the node, for messages and the failure summary.")
    node_rank: int = Field(ge=0, description="Index of this node among the job's nodes.")
    nnodes: int = Field(ge=1, description="Number of nodes in the job.")
    world_size: int = Field(ge=1, description="Number of ranks in the whole job.")
    ranks: list[int] = Field(min_length=1, description="Global rank of each process this node starts.")
    local_ranks: list[int] = Field(min_length=1, description="Local rank of each process, same order as `ranks`.")
    master_addr: str = Field(description="Address of the rendezvous (rank 0's TCP store).")
    master_port: int = Field(ge=1, le=65535, description="Port of the rendezvous.")
    command: list[str] = Field(min_length=1, description="argv of every rank (python, script, script args).")
    cwd: str = Field(description="Working directory of every rank.")
    env: dict[str, str] = Field(default_factory=dict, description="Variables added to the agent's environment for each rank.")
    grace_period: float = Field(10.0, ge=0, allow_inf_nan=False,
                                description="Seconds between SIGTERM and SIGKILL when tearing down.")
    rendezvous_timeout: float = Field(DEFAULT_RENDEZVOUS_TIMEOUT, gt=0, allow_inf_nan=False,
                                      description="Seconds the ranks wait for each other at start-up; "
                                                  "exported as DSRUN_RENDEZVOUS_TIMEOUT.")
    hang_timeout: float = Field(DEFAULT_HANG_TIMEOUT, ge=0, allow_inf_nan=False,
                                description="Seconds a rank may go without a heartbeat, once it began to beat, "
                                            "before it is reported hung; 0: no hang detection.")
    pass_local_rank: bool = Field(False, description="Append --local_rank=N to the rank command (DeepSpeed's convention).")
    log_dir: str | None = Field(None, description="If set, each rank's output is also written to log_dir/rank_N.log.")
    restart_count: int = Field(0, ge=0, description="How many times the launcher restarted the job before this "
                                                    "attempt (dsrun --max_restarts); exported as "
                                                    "DSRUN_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT.")

    @model_validator(mode="after")
    def _check_consistency(self) -> "NodeJob":
        if len(self.ranks) != len(self.local_ranks):
            raise ValueError(
                f"ranks ({len(self.ranks)} entries) and local_ranks ({len(self.local_ranks)} entries) "
                "must have the same length: one local rank per global rank"
            )
        bad = [r for r in self.ranks if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"ranks {bad} are outside the world of size {self.world_size}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ranks {self.ranks} contain duplicates")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        return self

    def to_json_line(self) -> str:
        """The job as one line of JSON ending in a newline (the agent reads one line)."""
        return self.model_dump_json() + "\n"

    @classmethod
    def from_json_line(cls, line: str | bytes) -> "NodeJob":
        """Parse a job written by `to_json_line`; raises pydantic.ValidationError if malformed."""
        return cls.model_validate_json(line)


def local_node_job(
    command: list[str],
    num_procs: int,
    master_addr: str,
    master_port: int,
    *,
    grace_period: float,
    pass_local_rank: bool,
    log_dir: str | None,
    job_id: str | None = None,
) -> NodeJob:
    """The single-node job of a local launch: ranks 0..num_procs-1 on this host."""
    return NodeJob(
        job_id=job_id or new_job_id(),
        host="localhost",
        node_rank=0,
        nnodes=1,
        world_size=num_procs,
        ranks=list(range(num_procs)),
        local_ranks=list(range(num_procs)),
        master_addr=master_addr,
        master_port=master_port,
        command=command,
        cwd=os.getcwd(),
        grace_period=grace_period,
        pass_local_rank=pass_local_rank,
        log_dir=log_dir,
    )

"""The per-node job description that the head hands to each node's agent.

A `NodeJob` is everything an agent needs to start and watch the ranks of
one node: which global ranks it runs, where the rendezvous is, the rank
command, and how to tear down. It travels as one JSON line (on the agent's
stdin, locally or over an SSH channel), so it holds only plain data.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from dsrun.launcher.records import parse_record, record_json

# Seconds the ranks of a dsrun job wait for each other at start-up (see dsrun.runtime.distributed.rendezvous).
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0
# Seconds without a heartbeat after which a rank is reported hung (see [Note: hung ranks] in hang.py).
DEFAULT_HANG_TIMEOUT = 600.0


def new_job_id() -> str:
    """A job id unique across hosts and time, e.g. ``dsrun-20240501-120000-1a2b3c4d``.

    It is exported to every rank as DSRUN_JOB_ID, which also lets tools find
    every process of a job (each rank carries it in its environment).
    """
    return f"dsrun-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(4).hex()}"


class InvalidNodeJob(ValueError):
    """A NodeJob whose fields have the wrong type, are out of range, or contradict each other."""


@dataclass(frozen=True, kw_only=True)
class NodeJob:
    """What one node's agent runs: its ranks, the rendezvous and the command.

    Attributes:
        job_id: unique id of the whole job; exported as DSRUN_JOB_ID.
        host: name of the node, for messages and the failure summary.
        node_rank: index of this node among the job's nodes (>= 0).
        nnodes: number of nodes in the job (>= 1).
        world_size: number of ranks in the whole job (>= 1).
        ranks: global rank of each process this node starts (at least one).
        local_ranks: local rank of each process, same order as `ranks`.
        master_addr: address of the rendezvous (rank 0's TCP store).
        master_port: port of the rendezvous (1-65535).
        command: argv of every rank (python, script, script args).
        cwd: working directory of every rank.
        env: variables added to the agent's environment for each rank.
        grace_period: seconds between SIGTERM and SIGKILL when tearing down (>= 0).
        rendezvous_timeout: seconds the ranks wait for each other at start-up
            (> 0); exported as DSRUN_RENDEZVOUS_TIMEOUT.
        hang_timeout: seconds a rank may go without a heartbeat, once it began
            to beat, before it is reported hung; 0: no hang detection.
        pass_local_rank: append --local_rank=N to the rank command (DeepSpeed's convention).
        log_dir: if set, each rank's output is also written to log_dir/rank_N.log.
        restart_count: how many times the launcher restarted the job before this
            attempt (dsrun --max_restarts); exported as DSRUN_RESTART_COUNT and
            TORCHELASTIC_RESTART_COUNT.

    Raises:
        InvalidNodeJob (a ValueError): a field of the wrong type or out of
            range, or fields that contradict each other (rank lists of
            different lengths, a rank outside the world, a node rank outside
            the node count). See [Note: no pydantic in the agent] in records.py.
    """

    job_id: str
    host: str = "localhost"
    node_rank: int
    nnodes: int
    world_size: int
    ranks: list[int]
    local_ranks: list[int]
    master_addr: str
    master_port: int
    command: list[str]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    grace_period: float = 10.0
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT
    hang_timeout: float = DEFAULT_HANG_TIMEOUT
    pass_local_rank: bool = False
    log_dir: str | None = None
    restart_count: int = 0

    def __post_init__(self) -> None:
        for name in ("job_id", "host", "master_addr", "cwd"):
            _check(self, name, isinstance(getattr(self, name), str), "a string")
        if self.log_dir is not None:
            _check(self, "log_dir", isinstance(self.log_dir, str), "a string or null")
        _check(self, "pass_local_rank", isinstance(self.pass_local_rank, bool), "true or false")
        for name, low, high in (("node_rank", 0, None), ("nnodes", 1, None), ("world_size", 1, None),
                                ("master_port", 1, 65535), ("restart_count", 0, None)):
            value = getattr(self, name)
            _check(self, name, _is_int(value) and value >= low and (high is None or value <= high),
                   f"an integer >= {low}" + (f" and <= {high}" if high is not None else ""))
        for name, positive in (("grace_period", False), ("rendezvous_timeout", True), ("hang_timeout", False)):
            value = getattr(self, name)
            ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
            _check(self, name, ok and (value > 0 if positive else value >= 0),
                   f"a finite number {'> 0' if positive else '>= 0'}")
            object.__setattr__(self, name, float(value))
        for name, test, what in (("ranks", _is_int, "integers"), ("local_ranks", _is_int, "integers"),
                                 ("command", lambda v: isinstance(v, str), "strings")):
            value = getattr(self, name)
            _check(self, name, isinstance(value, list) and len(value) >= 1 and all(map(test, value)),
                   f"a non-empty list of {what}")
        _check(self, "env", isinstance(self.env, dict)
               and all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()),
               "an object of string values")
        if len(self.ranks) != len(self.local_ranks):
            raise InvalidNodeJob(
                f"ranks ({len(self.ranks)} entries) and local_ranks ({len(self.local_ranks)} entries) "
                "must have the same length: one local rank per global rank"
            )
        bad = [r for r in self.ranks if not 0 <= r < self.world_size]
        if bad:
            raise InvalidNodeJob(f"ranks {bad} are outside the world of size {self.world_size}")
        if len(set(self.ranks)) != len(self.ranks):
            raise InvalidNodeJob(f"ranks {self.ranks} contain duplicates")
        if self.node_rank >= self.nnodes:
            raise InvalidNodeJob(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")

    def to_json_line(self) -> str:
        """The job as one line of JSON ending in a newline (the agent reads one line)."""
        return record_json(self) + "\n"

    @classmethod
    def from_json_line(cls, line: str | bytes) -> "NodeJob":
        """Parse a job written by `to_json_line`.

        Raises:
            InvalidNodeJob: not one JSON object, an unknown or missing field,
                or a field `NodeJob` rejects.
        """
        return parse_record(cls, line, InvalidNodeJob)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(job: NodeJob, name: str, ok: bool, what: str) -> None:
    if not ok:
        raise InvalidNodeJob(f"NodeJob.{name} must be {what}, got {getattr(job, name)!r}")


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

"""The start-up rendezvous: every rank meets at rank 0's TCP store, or fails naming who is missing.

[Note: bounded rendezvous]
torch's `env://` rendezvous waits up to the collective timeout (30 minutes)
and then reports only a count. A job whose MASTER_ADDR is wrong, or one of
whose ranks never started, would hang that long. Here rank 0 opens the
TCP store at MASTER_ADDR:MASTER_PORT (without waiting in the constructor),
every rank connects and adds itself to an arrival counter and its own key,
and each waits until the counter reaches the world size. After
DSRUN_RENDEZVOUS_TIMEOUT seconds (dsrun's `--rendezvous_timeout`; outside
dsrun the collective timeout) every waiting rank fails with the list of
ranks that never arrived, and a rank that cannot reach the store at all
says which address it tried. The store then serves the process group
exactly as `env://` would (same key prefix, same timeout afterwards).
"""
from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from dsrun.env import RENDEZVOUS_TIMEOUT, EnvVarError

_POLL_S = 0.05


class RendezvousError(RuntimeError):
    """The ranks could not all meet at the rendezvous; the message says who is missing or what was unreachable."""


def rendezvous_timeout(default: datetime.timedelta) -> float:
    """Seconds to wait for every rank: DSRUN_RENDEZVOUS_TIMEOUT if set, else `default`.

    Raises:
        RendezvousError: DSRUN_RENDEZVOUS_TIMEOUT is not a positive number.
    """
    try:
        value = RENDEZVOUS_TIMEOUT.read()
    except EnvVarError as e:
        raise RendezvousError(str(e)) from None
    return default.total_seconds() if value is None else value


def _names(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:20])) + (f" and {len(ranks) - 20} more" if len(ranks) > 20 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def join(rank: int, world_size: int, addr: str, port: int, timeout: float,
         pg_timeout: datetime.timedelta) -> dist.Store:
    """Meet every rank at rank 0's TCP store (see [Note: bounded rendezvous]); returns the store for the process group.

    Args:
        timeout: seconds to wait for the store and for every rank.
        pg_timeout: the timeout the store keeps afterwards (the collective timeout).

    Raises:
        RendezvousError: the store at `addr:port` cannot be opened or reached
            within `timeout`, or some ranks did not arrive (named).
    """
    # Under torchrun with an agent store, the agent hosts the store and every rank is a client.
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    how = "dsrun --rendezvous_timeout, or DSRUN_RENDEZVOUS_TIMEOUT"
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=hosts_store,
                              timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, ValueError) as exc:  # DistStoreError and DistNetworkError are RuntimeErrors
        cause = str(exc).splitlines()[0].rstrip(".") if str(exc) else type(exc).__name__
        doing = f"open the rendezvous store on port {port}" if hosts_store else \
            f"reach the rendezvous (rank 0's store) at {addr}:{port} within {timeout:g} s"
        raise RendezvousError(
            f"rank {rank} could not {doing}: {cause}; "
            "check that MASTER_ADDR is rank 0's host as every node sees it and that MASTER_PORT is free there "
            f"and open, or wait longer ({how})") from None
    # torchrun's agent store outlives a restart of the ranks: count each attempt apart.
    key = f"dsrun/rendezvous/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{key}/rank/{rank}", "1")
    deadline = time.monotonic() + timeout
    arrived = store.add(f"{key}/arrived", 1)
    while arrived < world_size:
        if time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if not store.check([f"{key}/rank/{r}"])]
            raise RendezvousError(
                f"{_names(missing)} never arrived at the rendezvous at {addr}:{port} within {timeout:g} s "
                f"(rank {rank} waited; {world_size - len(missing)} of {world_size} arrived): not started, "
                f"crashed before init_distributed, or unable to reach {addr}:{port}; wait longer with {how}")
        time.sleep(_POLL_S)
        arrived = store.add(f"{key}/arrived", 0)
    store.set_timeout(pg_timeout)
    return dist.PrefixStore("default_pg", store)

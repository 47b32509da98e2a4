"""Per-node launches (`dsrun --no_ssh`): every node runs `dsrun` itself and starts only its own ranks.

[Note: per-node launch]
SkyPilot, Kubernetes (Kubeflow's PyTorchJob / Trainer) and hand-written
scripts start the same command on every node; nothing connects from one
node to another except the ranks' rendezvous. As with DeepSpeed's
`--no_ssh --node_rank K`, each node's dsrun places the whole job (the same
way on every node, so the global ranks agree), starts the ranks of node K
through a local agent and waits for them; the ranks of all nodes meet at
MASTER_ADDR:MASTER_PORT. What each node needs comes from, first to last:

    nodes       --hostfile | SKYPILOT_NODE_IPS (one address a line) | PET_NNODES
    node rank   --node_rank | SKYPILOT_NODE_RANK | PET_NODE_RANK
    ranks/node  the hostfile's slots (slots=0: --num_procs) | --num_procs |
                SKYPILOT_NUM_GPUS_PER_NODE | PET_NPROC_PER_NODE | one per GPU, else 1
    master      --master_addr | PET_MASTER_ADDR | the first node's address
    port        --master_port | PET_MASTER_PORT | 29500

There is no free-port fallback (the nodes could not agree on it) and no
restart (no node sees the others' ranks): each node's dsrun exits with its
own ranks' status, and a rank that fails makes its peers on other nodes
fail in their next collective. PET_NNODES given as a range (`1:4`, elastic
torchrun) is refused: dsrun's per-node mode has a fixed node count.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dsrun.launcher.hostfile import Host
from dsrun.launcher.ports import DEFAULT_MASTER_PORT


class PerNodeError(ValueError):
    """The per-node launch lacks the node list, this node's rank or the master; the message names the sources."""


@dataclass(frozen=True)
class PerNodeLaunch:
    """What this node's dsrun needs: every node (in node-rank order), this node's rank and the rendezvous."""

    hosts: list[Host]
    node_rank: int
    master_addr: str
    master_port: int
    source: str


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise PerNodeError(f"{name}={raw!r} is not a whole number"
                           + ("; dsrun's --no_ssh needs a fixed node count, not a range" if ":" in raw else ""))
    return int(raw)


def _ranks_per_node(environ: Mapping[str, str], num_procs: int | None, default) -> int:
    """--num_procs, else SKYPILOT_NUM_GPUS_PER_NODE or PET_NPROC_PER_NODE when a positive number, else `default()`."""
    if num_procs is not None:
        return num_procs
    for name in ("SKYPILOT_NUM_GPUS_PER_NODE", "PET_NPROC_PER_NODE"):
        raw = environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:  # 0 (CPU nodes) and torchrun's "auto"/"gpu" mean: decide here
            return int(raw)
    return default()


def nodes_from_environment(environ: Mapping[str, str], num_procs: int | None, default_procs) -> tuple[list[Host], str]:
    """Every node of a SkyPilot or Kubeflow job, from its variables (see [Note: per-node launch]).

    `default_procs()` gives the ranks per node when nothing else does.

    Raises:
        PerNodeError: neither SKYPILOT_NODE_IPS nor PET_NNODES is set, or
            they disagree with SKYPILOT_NUM_NODES.
    """
    ips = environ.get("SKYPILOT_NODE_IPS", "").split()
    if ips:
        expected = _int(environ, "SKYPILOT_NUM_NODES")
        if expected is not None and expected != len(ips):
            raise PerNodeError(f"SKYPILOT_NUM_NODES={expected} but SKYPILOT_NODE_IPS lists {len(ips)} address(es)")
        per = _ranks_per_node(environ, num_procs, default_procs)
        return [Host(ip, per) for ip in ips], "SKYPILOT_NODE_IPS"
    nnodes = _int(environ, "PET_NNODES")
    if nnodes:
        per = _ranks_per_node(environ, num_procs, default_procs)
        # Kubeflow names only the master; the other nodes' names do not matter to anyone but the table.
        first = environ.get("PET_MASTER_ADDR", "node-0")
        return [Host(first, per)] + [Host(f"node-{k}", per) for k in range(1, nnodes)], "PET_NNODES"
    raise PerNodeError("--no_ssh needs every node of the job: give --hostfile (the same on every node), or run "
                       "where SKYPILOT_NODE_IPS (SkyPilot) or PET_NNODES (Kubeflow) is set")


def per_node_launch(environ: Mapping[str, str], hosts: list[Host], source: str, node_rank: int | None,
                    master_addr: str | None, master_port: int | None) -> PerNodeLaunch:
    """This node's rank and the rendezvous of a per-node launch over `hosts` (see [Note: per-node launch]).

    Raises:
        PerNodeError: no node rank is given or it is out of range.
    """
    names = ("--node_rank", "SKYPILOT_NODE_RANK", "PET_NODE_RANK")
    if node_rank is None:
        node_rank = next((v for v in (_int(environ, "SKYPILOT_NODE_RANK"), _int(environ, "PET_NODE_RANK"))
                          if v is not None), None)
    if node_rank is None:
        raise PerNodeError(f"--no_ssh: which node is this? give {names[0]} K (0 on the master node), or run where "
                           f"{' or '.join(names[1:])} is set")
    if not 0 <= node_rank < len(hosts):
        raise PerNodeError(f"node rank {node_rank} is out of range: {source} gives {len(hosts)} node(s), "
                           f"so it must be 0..{len(hosts) - 1}")
    addr = master_addr or environ.get("PET_MASTER_ADDR") or hosts[0].name
    port = master_port or _int(environ, "PET_MASTER_PORT") or DEFAULT_MASTER_PORT
    return PerNodeLaunch(hosts, node_rank, addr, port, source)

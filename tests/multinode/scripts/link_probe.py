"""What crosses the link between two nodes, for tests/multinode/test_node_link.py.

Run by dsrun on 2 nodes x 2 ranks (node-b in its network namespace,
tests/multinode/netns_link.py). Through dsrun.comm, every rank all-reduces
--mib MiB of fp32 --iters times on the world group, then as often on its
node's group ([0, 1] or [2, 3]). Rank 0 runs on node-a, where the veth
counters live, reads them around each phase (between barriers) and prints

    PROBE {"world": BYTES, "node": BYTES, "world_seconds": S, "world_transports": {...}, "node_transports": {...}}

with the link bytes of each phase, the world phase's seconds, and the
transports the comms logger recorded for each phase's all-reduces.
"""
import argparse
import json
import time
from pathlib import Path

import torch

import dsrun.comm as dist
from dsrun.runtime.comm.logger import comms_logger

p = argparse.ArgumentParser()
p.add_argument("--mib", type=float, default=2.0)
p.add_argument("--iters", type=int, default=3)
p.add_argument("--iface", required=True, help="node-a's end of the link (NodeLink.iface_a)")
p.add_argument("--local_rank", type=int, default=-1)
args = p.parse_args()

torch.set_num_threads(1)
dist.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
node_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
mine = node_groups[rank // 2]
x = torch.ones(int(args.mib * 2**20) // 4)
stats = Path("/sys/class/net") / args.iface / "statistics"


def link_bytes() -> int:
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text()) if rank == 0 else 0


def phase(group) -> tuple[int, float]:
    dist.barrier()
    before, t0 = link_bytes(), time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x, group=group)
    dist.barrier(group=group)
    seconds = time.perf_counter() - t0
    dist.barrier()
    return link_bytes() - before, seconds


def transports() -> dict[str, int]:
    record = comms_logger.snapshot()["all_reduce"]
    comms_logger.reset()
    return dict(record.transports)


comms_logger.reset()
world, world_seconds = phase(None)
world_transports = transports()
node, _ = phase(mine)
if rank == 0:
    print("PROBE " + json.dumps({"world": world, "node": node, "world_seconds": world_seconds,
                                 "world_transports": world_transports, "node_transports": transports()}), flush=True)

"""Ranks for the hang tests: a few steps, each one all_reduce through dsrun.comm.

    hang_steps.py MODE SECONDS STEPS
    block    rank 1 blocks for ever before the all_reduce of step 2 (rank 0 then waits inside it)
    slow     every rank sleeps SECONDS before each step's all_reduce
    startup  rank 1 sleeps SECONDS after init_distributed, before its first collective
"""
import sys
import threading
import time

import torch

import dsrun.comm as dist

mode, seconds, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
dist.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
if mode == "startup" and rank == 1:
    time.sleep(seconds)
for step in range(steps):
    if mode == "block" and rank == 1 and step == 2:
        print("blocking", flush=True)
        threading.Event().wait()  # a deadlocked data loader, say
    if mode == "slow":
        time.sleep(seconds)
    total = torch.ones(4)
    dist.all_reduce(total)
    assert total[0].item() == dist.get_world_size()
print("done", flush=True)

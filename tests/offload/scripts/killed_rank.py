"""A rank that builds an NVMe-offloaded engine, steps once and is SIGKILLed (rank 1) or waits (rank 0)."""
import os
import signal
import sys
import time

import torch

import dsrun

nvme = sys.argv[1]
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
engine.backward(engine(torch.randn(2, 64)).square().mean())
engine.step()
print(f"SWAP {engine.strategy.optimizer_tier.swap.path}", flush=True)
if engine.global_rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)  # rank 0 is stopped by the launcher when rank 1 dies

"""A tiny dsrun training run for the launcher progress test: 40 steps of a linear model."""
import time

import torch

import dsrun

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
engine, *_ = dsrun.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
    "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 40, "warmup_num_steps": 2}}})
for step in range(40):
    x = torch.randn(4, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    time.sleep(0.02)
print(f"rank {engine.global_rank} done", flush=True)

"""Rank script of tests/faults/test_restarts.py: a tiny MLP trained under
config `checkpoint.auto_resume`, with a checkpoint after every optimizer step.

argv: SAVE_DIR OUT_FILE STEPS DATA [--die RANK:STEP] [--hang RANK:STEP] [--down_config SRC DST] [--elastic]

DATA "loader": samples come from initialize's data loader and the model has
dropout, so a resumed run matches only if the loader's position and every
RNG state came back. DATA "step": step s's global batch (train_batch_size samples) is
generated from s and split over however many ranks there are (sample
i * world + rank is this rank's micro-batch i), without dropout: the same
samples at any world size.
--elastic: the batch sizes come from an `elasticity` section (version 0.1,
micro-batches [1], max_train_batch_size 12, 1-4 ranks: a global batch of 12
on any of 1-4 ranks) instead of train_batch_size 8.

--die RANK:STEP: on the first attempt only (DSRUN_RESTART_COUNT 0 and, under
Slurm, SLURM_RESTART_COUNT 0 or unset: neither dsrun nor Slurm restarted it), RANK
SIGKILLs itself in step STEP, after its first micro-batch's backward.
--hang RANK:STEP: instead, on the first attempt only, RANK blocks for ever
in step STEP, after its first micro-batch's backward, in a receive from the
next rank that no rank sends; the other ranks wait in the step's
collectives for it. Only the launcher's --hang_timeout ends that attempt.
--down_config SRC DST: just before the kill, copy SRC over DST (the launcher's
ssh config), so that the dying rank's node fails the restart's pre-check.

Rank 0 appends one JSON line per step to OUT_FILE: {"step", "loss" (the mean
over the global batch), "world", "restart", "slurm_restart", "batch" (the engine's
train_batch_size), "gas" (its gradient accumulation steps)}; at the end {"final": the
parameters as lists of floats}.
"""
import argparse
import json
import os
import shutil
import signal

import torch
import torch.distributed as dist

import dsrun
from dsrun.runtime.engine.dataloader import RepeatingLoader

parser = argparse.ArgumentParser()
parser.add_argument("save_dir")
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("data", choices=["loader", "step"])
parser.add_argument("--die", default=None)
parser.add_argument("--hang", default=None)
parser.add_argument("--down_config", nargs=2, default=None)
parser.add_argument("--elastic", action="store_true")
args = parser.parse_args()

restart = int(os.environ["DSRUN_RESTART_COUNT"])
assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(restart)
slurm_restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
first_attempt = restart == 0 and slurm_restart == 0
torch.manual_seed(0)
dropout = 0.3 if args.data == "loader" else 0.0
net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1))
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
batch = ({"elasticity": {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [1], "min_gpus": 1,
                         "max_gpus": 4, "version": 0.1}}
         if args.elastic else {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1})
engine, _, loader, _ = dsrun.initialize(
    model=net, training_data=data if args.data == "loader" else None,
    config={**batch, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1},
            "checkpoint": {"auto_resume": True, "save_dir": args.save_dir, "keep_last": 2}})
rank, world, gas = engine.global_rank, engine.world_size, engine.gradient_accumulation_steps()
GLOBAL_BATCH = engine.train_batch_size()
die_rank, die_step = map(int, args.die.split(":")) if args.die else (-1, -1)
hang_rank, hang_step = map(int, args.hang.split(":")) if args.hang else (-1, -1)


def step_samples(step: int):
    """This rank's micro-batches of step `step` in "step" mode."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 4, generator=gen), torch.randn(GLOBAL_BATCH, 1, generator=gen)
    return [(x[i * world + rank:i * world + rank + 1], y[i * world + rank:i * world + rank + 1]) for i in range(gas)]


batches = iter(RepeatingLoader(loader)) if loader is not None else None
while engine.global_steps < args.steps:
    step = engine.global_steps + 1
    micro = [next(batches) for _ in range(gas)] if batches is not None else step_samples(step)
    total = torch.zeros(1)
    for i, (x, y) in enumerate(micro):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        if first_attempt and rank == die_rank and step == die_step:
            if args.down_config:
                shutil.copyfile(*args.down_config)
            os.kill(os.getpid(), signal.SIGKILL)
        if first_attempt and rank == hang_rank and step == hang_step and i == 0:
            print(f"[rank {rank}] blocking in step {step}", flush=True)
            dist.recv(torch.zeros(1), src=(rank + 1) % world)  # never sent: blocks for ever
        engine.step()
        total += loss.detach()
    dist.all_reduce(total)
    engine.save_checkpoint(args.save_dir)
    if rank == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps({"step": step, "loss": total.item() / (gas * world), "world": world,
                                "restart": restart, "slurm_restart": slurm_restart,
                                "batch": GLOBAL_BATCH, "gas": gas}) + "\n")
if rank == 0:
    with open(args.out, "a") as f:
        f.write(json.dumps({"final": [p.detach().flatten().tolist() for p in engine.module.parameters()]}) + "\n")

"""Rank script of tests/faults/test_restarts.py: a tiny MLP trained under
config `checkpoint.auto_resume`, with a checkpoint after every optimizer step.

argv: SAVE_DIR OUT_FILE STEPS DATA [--die RANK:STEP] [--down_config SRC DST]

DATA "loader": samples come from initialize's data loader and the model has
dropout, so a resumed run matches only if the loader's position and every
RNG state came back. DATA "step": step s's global batch of 8 samples is
generated from s and split over however many ranks there are (sample
i * world + rank is this rank's micro-batch i), without dropout: the same
samples at any world size.

--die RANK:STEP: on the first attempt only (DSRUN_RESTART_COUNT 0), RANK
SIGKILLs itself in step STEP, after its first micro-batch's backward.
--down_config SRC DST: just before that, copy SRC over DST (the launcher's
ssh config), so that the dying rank's node fails the restart's pre-check.

Rank 0 appends one JSON line per step to OUT_FILE: {"step", "loss" (the mean
over the global batch), "world", "restart"}; at the end {"final": the
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
parser.add_argument("--down_config", nargs=2, default=None)
args = parser.parse_args()

GLOBAL_BATCH = 8
restart = int(os.environ["DSRUN_RESTART_COUNT"])
assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(restart)
torch.manual_seed(0)
dropout = 0.3 if args.data == "loader" else 0.0
net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1))
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
engine, _, loader, _ = dsrun.initialize(
    model=net, training_data=data if args.data == "loader" else None,
    config={"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1},
            "checkpoint": {"auto_resume": True, "save_dir": args.save_dir, "keep_last": 2}})
rank, world, gas = engine.global_rank, engine.world_size, engine.gradient_accumulation_steps()
die_rank, die_step = map(int, args.die.split(":")) if args.die else (-1, -1)


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
        if restart == 0 and rank == die_rank and step == die_step:
            if args.down_config:
                shutil.copyfile(*args.down_config)
            os.kill(os.getpid(), signal.SIGKILL)
        engine.step()
        total += loss.detach()
    dist.all_reduce(total)
    engine.save_checkpoint(args.save_dir)
    if rank == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps({"step": step, "loss": total.item() / (gas * world), "world": world,
                                "restart": restart}) + "\n")
if rank == 0:
    with open(args.out, "a") as f:
        f.write(json.dumps({"final": [p.detach().flatten().tolist() for p in engine.module.parameters()]}) + "\n")

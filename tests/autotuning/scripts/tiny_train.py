"""Rank script for the autotuner's end-to-end test: a small MLP trained on random data.

    dsrun --autotuning tune --num_procs 2 tiny_train.py --deepspeed_config cfg.json --steps 8

--max_micro_batch: the script refuses larger micro-batches (exit status 3),
a trial that fails on purpose.
"""
import argparse
import sys

import torch

import dsrun

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--max_micro_batch", type=int, default=1 << 30)
parser.add_argument("--local_rank", type=int, default=-1)
dsrun.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
engine, _, _, _ = dsrun.initialize(args=args, model=model, model_parameters=model.parameters())
mbs = engine.train_micro_batch_size_per_gpu()
if mbs > args.max_micro_batch:
    print(f"micro-batch {mbs} is larger than --max_micro_batch {args.max_micro_batch}", file=sys.stderr)
    sys.exit(3)
for step in range(args.steps):
    for _ in range(engine.gradient_accumulation_steps()):
        x = torch.randn(mbs, 32, device=engine.device)
        loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        engine.step()
print(f"trained {args.steps} steps, micro-batch {mbs}, final loss {loss.item():.4f}")

"""One training client for dsrun and DeepSpeed alike: a `PipelineModule` of
residual MLP blocks, timed per `train_batch` (launched by
bench/pipeline/vs_deepspeed.py under torchrun, once per library).

`import deepspeed` finds DeepSpeed in a venv that has it, else dsrun
(`import dsrun as deepspeed`); nothing else differs between the two runs.
Each rank runs 1 torch thread, gloo, fp32, ZeRO stage 0, SGD (lr 1e-3,
momentum 0.9) from the config, micro-batches of `--micro` samples of
`--width` values (`--seq` x `--width` with --seq > 0), target = the input
reversed along its first dimension after the batch (MSE loss). Block: x + W2 gelu(W1 x), W1: width -> hidden_mult x width.

Prints one JSON line on rank 0: the library, the per-step wall times (the
maximum over the ranks of each step, between barriers), the CPU seconds of
each step summed over the ranks (every thread of each process) and, under dsrun with
--action-timing, the per-rank table of `engine.last_action_times`.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    LIBRARY = deepspeed.__name__  # "dsrun" where the deepspeed alias of extras/ is installed
except ImportError:
    import dsrun as deepspeed
    from dsrun.pipe import LayerSpec, PipelineModule
    LIBRARY = "dsrun"


class Block(torch.nn.Module):
    """x + W2 gelu(W1 x) on the last dimension."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--hidden-mult", type=int, default=1)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--seq", type=int, default=0)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--action-timing", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    torch.manual_seed(1234)
    module = PipelineModule([LayerSpec(Block, args.width, args.width * args.hidden_mult)
                             for _ in range(args.blocks)], num_stages=args.stages, loss_fn=F.mse_loss,
                            partition_method="uniform")
    data = world // args.stages
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.micro_batches,
              "train_batch_size": args.micro * args.micro_batches * data,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}},
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**6, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
    timing = args.action_timing and hasattr(engine, "action_timing")
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = []
    for _ in range(args.micro_batches):
        x = torch.randn(args.micro, *([args.seq] if args.seq else []), args.width, generator=g)
        batches.append((x, x.flip(1)))
    times, cpu, tables = [], [], []
    for step in range(args.warmup + args.steps):
        if timing:
            engine.action_timing = step >= args.warmup
        dist.barrier()
        started, used = time.perf_counter(), time.process_time()
        engine.train_batch(iter(batches))
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - used)
        if timing and step >= args.warmup:
            tables.append(engine.last_action_times)
    spent = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    cpu_s = torch.tensor(cpu[args.warmup:], dtype=torch.float64)
    dist.all_reduce(cpu_s)
    gathered = [None] * world if timing else None
    if timing:
        dist.all_gather_object(gathered, {"rank": dist.get_rank(), "stage": engine.stage_id, "tables": tables})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"library": LIBRARY, "step_s": spent.tolist(), "cpu_s": cpu_s.tolist(),
                                 "actions": gathered}),
              flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()

"""One MoE training client for dsrun and DeepSpeed alike (launched by
bench/moe/vs_deepspeed.py under torchrun, once per library).

`import deepspeed` finds DeepSpeed in a venv that has it, else dsrun
(through its `deepspeed` alias). Model: Linear(width, width), then
`deepspeed.moe.layer.MoE` with `--experts` experts of width -> hidden ->
width (Linear, GELU, Linear), top-1, capacity factor 1.0, over `--ep`
expert-parallel ranks. Each rank feeds `--tokens` tokens per step; loss =
MSE(output, target) + 0.01 l_aux. 1 torch thread per rank, gloo, fp32, SGD
(lr 1e-3, momentum 0.9) from the config, optimizer groups split for the
experts (`split_params_into_different_moe_groups_for_optimizer`), ZeRO
stage `--zero`.

Prints one JSON line on rank 0: the library, per-step wall times (the
slowest rank's forward + backward + step, between barriers) and CPU seconds
per step summed over the ranks. --profile: rank 0 also prints the top
functions of a cProfile of the timed steps (by own time) to stderr.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import deepspeed
except ImportError:  # dsrun's venv: `deepspeed` as the alias of dsrun (dsrun/compat/alias.py)
    from dsrun.compat.alias import install
    install()
    import deepspeed
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

LIBRARY = deepspeed.__name__


class Net(torch.nn.Module):
    """Linear, then the MoE layer; returns (output, l_aux)."""

    def __init__(self, width: int, hidden: int, experts: int, ep: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        expert = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width))
        self.moe = MoE(hidden_size=width, expert=expert, num_experts=experts, ep_size=ep, k=1,
                       capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4)

    def forward(self, x):
        out, l_aux, _ = self.moe(self.inp(x))
        return out, l_aux


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, required=True)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = Net(args.width, args.hidden, args.experts, args.ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "params"})
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}},
              "zero_optimization": {"stage": args.zero}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.tokens, args.width, generator=g)
    target = x.flip(1)
    profile = cProfile.Profile() if args.profile and dist.get_rank() == 0 else None
    times, cpu = [], []
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        dist.barrier()
        if profile is not None and timed:
            profile.enable()
        started, used = time.perf_counter(), time.process_time()
        out, l_aux = engine(x)
        loss = F.mse_loss(out, target) + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - used)
        if profile is not None and timed:
            profile.disable()
    spent = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    cpu_s = torch.tensor(cpu[args.warmup:], dtype=torch.float64)
    dist.all_reduce(cpu_s)
    if dist.get_rank() == 0:
        if profile is not None:
            pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(30)
        print("RESULT " + json.dumps({"library": LIBRARY, "step_s": spent.tolist(), "cpu_s": cpu_s.tolist()}),
              flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()

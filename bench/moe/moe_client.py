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
slowest rank's forward + backward + step, between barriers), CPU seconds
per step summed over the ranks, and each rank's CPU seconds per step.
--profile DIR: every rank runs torch.profiler (CPU) over the timed steps
and writes DIR/<library>-ep<P>-z<stage>-r<rank>.json: per event name its
own and inclusive milliseconds per step and calls per step. Labelled
ranges: step.forward / step.backward / step.step (the engine calls),
moe.gate (the gate's routing; forward only) and moe.experts (the local
experts' forward); the rest are torch's ops and autograd's backward nodes
(vs_deepspeed.py --profile prints them side by side). The profiler's times
are wall times; beside them each labelled range's main-thread CPU ms per
step (thread_cpu_ms), and the CPU of the main thread and of the others
(gloo's, a communication thread's) over the whole step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

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


class Spans:
    """Labelled ranges for the profile: record_function(name) for
    torch.profiler, and the main thread's CPU seconds inside each name
    (time.thread_time: unlike the profiler's wall times, not inflated when
    other processes hold the cores), counted while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.cpu_s: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        started = time.thread_time()
        with record_function(name):
            yield
        if self.on:
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + time.thread_time() - started

    def label(self, module: torch.nn.Module, method: str, name: str) -> None:
        """Run `module.<method>` inside the span `name`."""
        inner = getattr(module, method)

        def labelled(*args, **kwargs):
            with self(name):
                return inner(*args, **kwargs)
        setattr(module, method, labelled)


def _events(prof, steps: int) -> dict[str, list[float]]:
    """{event name: [own ms, inclusive ms, calls], each per step}."""
    return {e.key: [e.self_cpu_time_total / 1e3 / steps, e.cpu_time_total / 1e3 / steps, e.count / steps]
            for e in prof.key_averages()}


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
    p.add_argument("--profile", metavar="DIR", default=None)
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
    prof = profile(activities=[ProfilerActivity.CPU]) if args.profile else None
    spans = Spans()
    span = spans if prof is not None else (lambda name: contextlib.nullcontext())
    if prof is not None:
        layer = model.moe.deepspeed_moe
        # dsrun's layer routes by gate.route (its dispatch form), DeepSpeed's by calling the gate.
        spans.label(layer.gate, "route" if hasattr(layer.gate, "route") else "forward", "moe.gate")
        spans.label(layer.experts, "forward", "moe.experts")
    times, cpu, main_cpu = [], [], 0.0
    for step in range(args.warmup + args.steps):
        dist.barrier()
        if prof is not None and step == args.warmup:
            prof.start()
            spans.on = True
        started, used, used_here = time.perf_counter(), time.process_time(), time.thread_time()
        with span("step.forward"):
            out, l_aux = engine(x)
            loss = F.mse_loss(out, target) + 0.01 * l_aux
        with span("step.backward"):
            engine.backward(loss)
        with span("step.step"):
            engine.step()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - used)
        main_cpu += (time.thread_time() - used_here) if spans.on else 0.0
    if prof is not None:
        prof.stop()
        out_file = Path(args.profile) / f"{LIBRARY}-ep{args.ep}-z{args.zero}-r{dist.get_rank()}.json"
        thread_cpu_ms = {name: s * 1e3 / args.steps for name, s in spans.cpu_s.items()}
        thread_cpu_ms["main thread"] = main_cpu * 1e3 / args.steps
        thread_cpu_ms["other threads"] = sum(cpu[args.warmup:]) * 1e3 / args.steps - thread_cpu_ms["main thread"]
        out_file.write_text(json.dumps({"library": LIBRARY, "rank": dist.get_rank(), "steps": args.steps,
                                        "cpu_s": cpu[args.warmup:], "thread_cpu_ms": thread_cpu_ms,
                                        "events": _events(prof, args.steps)}))
    spent = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    cpu_ranks = [torch.zeros(args.steps, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(cpu_ranks, torch.tensor(cpu[args.warmup:], dtype=torch.float64))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"library": LIBRARY, "step_s": spent.tolist(),
                                      "cpu_s": torch.stack(cpu_ranks).sum(dim=0).tolist(),
                                      "cpu_rank_s": [c.tolist() for c in cpu_ranks]}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()

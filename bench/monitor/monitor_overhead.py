"""Overhead of the monitors, the timers, progress records and the flops profiler on the demo's step.

    .venv/bin/dsrun --num_procs 2 bench/monitor/monitor_overhead.py [--rounds 6] [--steps 4]

Model and batch of `make demo` (examples/gpt_model.py: 0.84M parameters,
byte vocabulary, 16 windows of 128 tokens per rank, AdamW from the config,
ZeRO stage 0, fp32), 2 ranks, 1 torch thread each; random token windows
(the step's cost does not depend on the data).

One pair of processes holds one engine per configuration, each over its own
copy of the same model (same initial weights):
- none: no monitor, no timer, no records (the baseline);
- csv, tensorboard, wandb (WANDB_MODE=offline): one monitor each;
- all3: the three monitors together;
- breakdown: wall_clock_breakdown (its line every 10 steps);
- records: progress records, as under dsrun's launcher (printed to a null stream here).
Each round runs `--steps` steps of every configuration, in an order rotated
every round (A B C ..., then B C ... A), so the machine's changing load
hits all alike. A step is forward, backward and step with loss.item(), as
the demo does, timed on rank 0 between barriers. Reported per configuration:
the median step time over all rounds, its spread ((max - min) / median of
the per-round means), and the median over rounds of the ratio of the round's
mean step to the baseline's mean step in the same round; and, measured
directly because on a loaded machine that ratio is noisier than the cost
itself, the wall time of the engine's per-step report
(`StepTelemetry.end_step`: loss.item(), the peak-memory all-reduce, writing
the events, the breakdown line, the record) per step and its share of the
median step. Everything else a monitor adds per micro-batch is a
perf_counter pair per phase and a detached loss add.

The flops profiler runs once per engine; its cost is reported as the
profiled step's time over the median unprofiled step of the same engine,
over `--rounds` fresh engines (profile_step=1, the report written to a file).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import dsrun  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

MICRO, SEQ = 16, 128
BASE = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}}


def configurations(out: str) -> dict[str, dict]:
    def monitor(name: str) -> dict:
        return {"enabled": True, "output_path": out, "job_name": name}
    return {
        "none": {},
        "csv": {"csv_monitor": monitor("csv")},
        "tensorboard": {"tensorboard": monitor("tb")},
        "wandb": {"wandb": {"enabled": True, "project": "dsrun-bench"}},
        "all3": {"csv_monitor": monitor("csv3"), "tensorboard": monitor("tb3"),
                 "wandb": {"enabled": True, "project": "dsrun-bench3"}},
        "breakdown": {"wall_clock_breakdown": True},
        "records": {},
    }


def build(extra: dict, records: bool = False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=SEQ))
    os.environ["DSRUN_PROGRESS"] = "1" if records else "0"
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.param_groups(), config={**BASE, **extra})
    return engine


def time_end_step(engine) -> list[float]:
    """Wrap the engine's per-step report (monitor events, memory all-reduce, breakdown line,
    progress record) so that its own wall time per step is recorded; returns the list it fills."""
    telemetry, spent = engine._telemetry, []
    inner = telemetry.end_step

    def timed_end_step() -> None:
        t0 = time.perf_counter()
        inner()
        spent.append(time.perf_counter() - t0)
    telemetry.end_step = timed_end_step
    return spent


def step(engine, gen: torch.Generator) -> float:
    x = torch.randint(0, 256, (MICRO, SEQ + 1), generator=gen)
    dist.barrier()
    t0 = time.perf_counter()
    loss = engine(x[:, :-1], x[:, 1:])
    engine.backward(loss)
    engine.step()
    loss.item()
    dist.barrier()
    return time.perf_counter() - t0


def summary(name: str, times: list[float], ratios: list[float] | None, rounds: list[float],
            report: list[float]) -> str:
    med = statistics.median(times)
    spread = (max(rounds) - min(rounds)) / statistics.median(rounds)
    ratio = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "1 (baseline)"
    own = statistics.median(report)
    return (f"| {name} | {min(times) * 1e3:.0f} | {med * 1e3:.0f} | {spread:.0%} | {ratio} | "
            f"{own * 1e3:.2f} ({max(report) * 1e3:.1f}) | {own / med:.2%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed-style launchers
    args = p.parse_args()
    torch.set_num_threads(1)
    # the same path on every rank: ranks check that they resolved the same config
    out = os.path.join(tempfile.gettempdir(), f"dsrun-monitor-bench-{os.environ.get('MASTER_PORT', '0')}")
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=out, WANDB_SILENT="true")
    null = io.StringIO()
    with contextlib.redirect_stdout(null):  # progress records and the breakdown lines
        engines = {name: build(extra, records=name == "records") for name, extra in configurations(out).items()}
    report_times = {name: time_end_step(engine) for name, engine in engines.items()}
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    names = list(engines)
    for engine in engines.values():  # warm-up: first-step allocations, shm set-up
        with contextlib.redirect_stdout(null):
            step(engine, gen)
    per_step = {n: [] for n in names}
    per_round = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            with contextlib.redirect_stdout(null):
                times = [step(engines[name], gen) for _ in range(args.steps)]
            per_step[name] += times
            per_round[name].append(statistics.mean(times))
    # flops profiler: the profiled step against the same engine's other steps
    profiled = []
    for r in range(args.rounds):
        with contextlib.redirect_stdout(null):
            engine = build({"flops_profiler": {"enabled": True, "profile_step": 1,
                                               "output_file": os.path.join(out, f"flops{r}.txt")}})
            times = [step(engine, gen) for _ in range(4)]  # steps 0..3; step 1 is profiled
        profiled.append(times[1] / statistics.median([times[0], times[2], times[3]]))
    if rank == 0:
        print(f"step time, demo GPT, 2 ranks, {args.rounds} rounds x {args.steps} steps per configuration (ms)")
        print("| configuration | min | median | spread | ratio to none, median of rounds (min-max) "
              "| report ms/step, median (max) | report / median step |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            ratios = None if name == "none" else [a / b for a, b in zip(per_round[name], per_round["none"])]
            print(summary(name, per_step[name], ratios, per_round[name], report_times[name]))
        print(f"flops profiler: the profiled step / the same engine's median step = "
              f"{statistics.median(profiled):.2f} (min {min(profiled):.2f}, max {max(profiled):.2f}, "
              f"{len(profiled)} engines); it runs once per run")
    for engine in engines.values():
        engine.monitor.close()


if __name__ == "__main__":
    main()

"""Step time and peak RSS of the 48M GPT (bench/step_time/gpt_step.py), 2 ranks, ZeRO
stage 3, fp32, with and without offload, and where the offloaded step's time goes.

    .venv/bin/python bench/offload/offload_step.py [--repeats 3] [--warmup 2] [--steps 5]
        [--runs none,cpu,nvme,nvme+param] [--model 48m|small] [--nvme_path /tmp/dsrun-bench-offload]
        [--sub_group_size 10000000] [--buffer_count 4]

Configurations (everything else as gpt_step.py's dsrun-3: reduce/allgather
buckets of 5e6 elements, ds_config's AdamW = dsrun's native CPU Adam):
- none: no offload;
- cpu: offload_optimizer.device cpu (on this CPU-only machine host memory is
  the device memory: the same step, see [Note: optimizer tiers]);
- nvme: offload_optimizer.device nvme, moments (fp32 run: no separate
  master) streamed from swap files under --nvme_path;
- nvme+param: offload_param.device nvme too: partitions read for every
  gather, written back by the step.
Launches are interleaved (A B C D, A B C D, ...) on fresh pairs of
processes. Reported per configuration: min / median / spread of the step
(the slower rank's, between barriers), the median ratio to `none`, peak RSS
per rank over the timed steps (VmHWM after a reset at the end of warm-up)
and over the whole process (ru_maxrss), and for the offloaded runs the
median per step of: the optimizer step's wall time ("opt step"), the time
the CPU Adam ran in it ("adam"), the time it waited on swap-file I/O
("opt I/O wait"), the time spent waiting on parameter reads and writes
("param I/O wait"), and the bytes moved.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.step_time.gpt_step import GPT, LR, MODELS, WEIGHT_DECAY, Shape, _launch, _rank_env

RUNS = {"none": ("none", "none"), "cpu": ("cpu", "none"), "nvme": ("nvme", "none"),
        "nvme+param": ("nvme", "nvme")}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(key + ":"))


def _rank(run: str, s: Shape, nvme_path: str, sub_group: int, buffers: int, warmup: int, steps: int,
          rank: int, port: int, out) -> None:
    _rank_env({}, rank, port)
    import torch.distributed as dist

    import dsrun

    opt_dev, param_dev = RUNS[run]
    cfg = {"train_micro_batch_size_per_gpu": s.micro, "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": s.bucket, "allgather_bucket_size": s.bucket,
                                 "sub_group_size": sub_group,
                                 "offload_optimizer": {"device": opt_dev, "nvme_path": nvme_path,
                                                       "buffer_count": buffers},
                                 "offload_param": {"device": param_dev, "nvme_path": nvme_path}}}
    model = GPT(s)
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    opt_tier, param_tier = engine.strategy.optimizer_tier, engine.strategy.param_tier
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, s.vocab, (s.micro, s.seq + 1), generator=g) for _ in range(warmup + steps)]
    times, parts = [], []
    for i, batch in enumerate(data):
        if i == warmup:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS: the timed steps' own peak
        p0 = dict(getattr(param_tier, "stats", {}))
        dist.barrier()
        t0 = time.perf_counter()
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            o, p1 = opt_tier.stats, getattr(param_tier, "stats", {})
            parts.append({"opt step": o.get("step_s", 0.0), "adam": o.get("compute_s", 0.0),
                          "opt I/O wait": o.get("io_wait_s", 0.0),
                          "param I/O wait": p1.get("io_wait_s", 0.0) - p0.get("io_wait_s", 0.0),
                          "MB moved": (o.get("read_bytes", 0) + o.get("write_bytes", 0)
                                       + sum(p1.get(k, 0) - p0.get(k, 0) for k in ("read_bytes", "write_bytes")))
                                      / 1e6})
    out.put((rank, times, _status("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, parts,
             engine.memory_breakdown().get("nvme_swap", {}).get("fp32", 0)))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--model", default="48m", choices=sorted(MODELS))
    ap.add_argument("--nvme_path", default="/tmp/dsrun-bench-offload")
    ap.add_argument("--sub_group_size", type=int, default=10_000_000)
    ap.add_argument("--buffer_count", type=int, default=4)
    args = ap.parse_args()
    runs = args.runs.split(",")
    for r in runs:
        if r not in RUNS:
            raise SystemExit(f"unknown configuration {r!r}; known: {', '.join(RUNS)}")
    os.makedirs(args.nvme_path, exist_ok=True)
    s = MODELS[args.model]
    times = {r: [] for r in runs}
    peak = {r: [0, 0] for r in runs}
    maxrss = {r: [0, 0] for r in runs}
    parts = {r: [] for r in runs}
    swap = {}
    for rep in range(args.repeats):
        for r in runs:  # interleaved
            res = _launch(r, _rank, r, s, args.nvme_path, args.sub_group_size, args.buffer_count, args.warmup,
                          args.steps)
            t = [max(a, b) for a, b in zip(res[0][1], res[1][1])]
            times[r] += t
            peak[r] = [max(old, x[2]) for old, x in zip(peak[r], res)]
            maxrss[r] = [max(old, x[3]) for old, x in zip(maxrss[r], res)]
            parts[r] += res[0][4]
            swap[r] = res[0][5]
            print(f"[repeat {rep + 1}/{args.repeats}] {r}: median {statistics.median(t):.3f} s/step",
                  file=sys.stderr, flush=True)
    base = statistics.median(times[runs[0]])
    print(f"\n{args.model} GPT, ZeRO stage 3 fp32, 2 ranks x 1 thread, sub_group_size {args.sub_group_size}, "
          f"buffer_count {args.buffer_count}, nvme_path {args.nvme_path}; {args.repeats} interleaved repeats x "
          f"{args.steps} timed steps after {args.warmup} warm-up\n")
    print(f"| run | min s/step | median s/step | spread | vs {runs[0]} | peak RSS timed steps r0/r1 (MiB) | "
          "ru_maxrss r0/r1 (MiB) | swap files r0 (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        ts = times[r]
        med = statistics.median(ts)
        print(f"| {r} | {min(ts):.3f} | {med:.3f} | {(max(ts) - min(ts)) / med:.1%} | {med / base:.3f} | "
              f"{peak[r][0]} / {peak[r][1]} | {maxrss[r][0]} / {maxrss[r][1]} | {swap[r] / 1e6:.0f} |")
    keys = ["opt step", "adam", "opt I/O wait", "param I/O wait", "MB moved"]
    print("\nRank 0, median per timed step (s; MB moved = swap-file reads + writes):\n")
    print("| run | step | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for r in runs:
        med = {k: statistics.median(p[k] for p in parts[r]) for k in keys}
        print(f"| {r} | {statistics.median(times[r]):.3f} | " + " | ".join(
            f"{med[k]:.0f}" if k == "MB moved" else f"{med[k]:.3f}" for k in keys) + " |")


if __name__ == "__main__":
    main()

"""Bytes per step and step time of the 1-bit optimizers against plain Adam, on 2 ranks.

    .venv/bin/python bench/compression/onebit_step.py [--model small|48m] [--repeats 3]
        [--warmup 4] [--steps 4] [--runs adam,adam-fp16comm,onebitadam,zerooneadam,onebitlamb]
        (a 1-bit run with -pytorch appended: compression without the native kernels)

Model: the GPT of bench/step_time/gpt_step.py (`48m`: 48.0M parameters;
`small`: 5.2M), fp32 compute, ZeRO stage 0, 2 ranks of 1 torch thread on
one machine, the same data on every run.

Configurations (lr 1e-4, weight decay 0.01, gradient_clipping 0):
- adam: "AdamW" (dsrun's native Adam); gradients all-reduced in fp32 over
  shared memory, 4 bytes per element.
- adam-fp16comm: the same with "communication_data_type": "fp16" -- the
  fp16 all-reduce the 1-bit optimizers are measured against.
- onebitadam: "OneBitAdam", freeze_step = --warmup (every timed step is
  after warm-up: momentum exchanged 1-bit compressed over gloo).
- zerooneadam: "ZeroOneAdam", var_freeze_step = --warmup - 1 (local steps
  from step --warmup + 1, DeepSpeed's count),
  local_step_scaler 1, local_step_clipper 4: after warm-up the interval
  between synchronisations doubles every step up to 4, so most timed
  steps send nothing (DeepSpeed's defaults keep it at 1 for 32678 steps).
- onebitlamb: "OneBitLamb", freeze_step = --warmup.
- onebitadam-pytorch, zerooneadam-pytorch, onebitlamb-pytorch: the same
  with DSRUN_OPS_DISABLE=quantizer in the ranks, so the compression runs
  comm/compressed.py's PyTorch code instead of the native kernels
  (dsrun/ops/quantizer.py): what the kernels save per step.

Each launch is a fresh pair of processes running --warmup untimed steps,
then --steps timed ones (forward + backward + step between barriers, the
slower rank's time); configurations are interleaved (A B C ... A B C ...)
over --repeats. Reported per configuration: min / median / spread of the
step time, its ratio to the first configuration's median, the bus bytes each rank sent per
timed step (comms logger, dsrun/runtime/comm/logger.py; all ops) and the
ratio of adam-fp16comm's bytes to it. Losses are not compared: a warm-up of a
few steps leaves the frozen variance far from converged (the optimizers
need freeze_step in the thousands; tests/compression checks that each one
trains).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step_time"))

import torch  # noqa: E402

from gpt_step import GPT, MODELS, _launch, _rank_env  # noqa: E402  (the same model and launcher)

LR, WEIGHT_DECAY = 1e-4, 0.01
RUNS = ("adam", "adam-fp16comm", "onebitadam", "zerooneadam", "onebitlamb")
PYTORCH = "-pytorch"  # suffix: the compression's PyTorch path instead of the native kernels


def _config(run: str, s, warmup: int) -> dict:
    common = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    run = run.removesuffix(PYTORCH)
    optimizer = {
        "adam": {"type": "AdamW", "params": common},
        "adam-fp16comm": {"type": "AdamW", "params": common},
        "onebitadam": {"type": "OneBitAdam", "params": {**common, "freeze_step": warmup}},
        "zerooneadam": {"type": "ZeroOneAdam", "params": {**common, "var_freeze_step": warmup - 1,
                                                          "local_step_scaler": 1, "local_step_clipper": 4}},
        "onebitlamb": {"type": "OneBitLamb", "params": {**common, "freeze_step": warmup}},
    }[run]
    cfg = {"train_micro_batch_size_per_gpu": s.micro, "gradient_clipping": 0.0, "optimizer": optimizer,
           "zero_optimization": {"stage": 0, "reduce_bucket_size": s.bucket}, "steps_per_print": 10 ** 9}
    if run == "adam-fp16comm":
        cfg["communication_data_type"] = "fp16"
    return cfg


def _rank(run: str, s, warmup: int, steps: int, rank: int, port: int, out) -> None:
    _rank_env({"DSRUN_OPS_DISABLE": "quantizer"} if run.endswith(PYTORCH) else {}, rank, port)
    import torch.distributed as dist

    import dsrun

    model = GPT(s)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, s.vocab, (s.micro, s.seq + 1), generator=g) for _ in range(warmup + steps)]
    engine, *_ = dsrun.initialize(model=model, config=_config(run, s, warmup))
    times = []
    for i, batch in enumerate(data):
        if i == warmup:
            dsrun.comm.comms_logger.reset()
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    stats = dsrun.comm.comms_logger.snapshot()
    stats.pop("barrier", None)
    per_op = {op: st.bus_bytes / steps for op, st in stats.items()}
    out.put((rank, times, per_op))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--runs", default=",".join(RUNS))
    args = ap.parse_args()
    s = MODELS[args.model]
    runs = args.runs.split(",")
    for run in runs:
        if run.removesuffix(PYTORCH) not in RUNS or run in ("adam" + PYTORCH, "adam-fp16comm" + PYTORCH):
            raise SystemExit(f"unknown configuration {run!r}; known: {', '.join(RUNS)}, and the 1-bit ones "
                             f"with {PYTORCH}")
    times = {r: [] for r in runs}
    bytes_ = {}
    for rep in range(args.repeats):
        for run in runs:  # interleaved
            results = _launch(run, _rank, run, s, args.warmup, args.steps)
            t = [max(a, b) for a, b in zip(results[0][1], results[1][1])]
            times[run] += t
            bytes_[run] = results[0][2]
            print(f"[repeat {rep + 1}/{args.repeats}] {run}: median {statistics.median(t):.3f} s/step, "
                  f"{sum(results[0][2].values()) / 2**20:.2f} MiB/step", file=sys.stderr, flush=True)
    n = sum(p.numel() for p in GPT(s).parameters())
    print(f"\nGPT {args.model} ({n / 1e6:.1f}M parameters), 2 ranks x 1 thread, fp32, stage 0; {args.repeats} "
          f"interleaved repeat(s) x {args.steps} timed steps after {args.warmup} warm-up steps\n")
    print(f"| run | min s/step | median s/step | spread | vs {runs[0]} | bus MiB/step (rank 0) | "
          "fp16 all-reduce / this | MiB/step per op |")
    print("|---|---|---|---|---|---|---|---|")
    base_t = statistics.median(times[runs[0]])
    fp16 = sum(bytes_.get("adam-fp16comm", {}).values())
    for run in runs:
        ts, b = times[run], sum(bytes_[run].values())
        med = statistics.median(ts)
        ops = ", ".join(f"{op} {v / 2**20:.2f}" for op, v in sorted(bytes_[run].items()) if v)
        print(f"| {run} | {min(ts):.3f} | {med:.3f} | {(max(ts) - min(ts)) / med:.1%} | {med / base_t:.2f} | "
              f"{b / 2**20:.3f} | {fp16 / b if b and fp16 else float('nan'):.1f} | {ops} |")


if __name__ == "__main__":
    main()

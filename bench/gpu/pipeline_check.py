"""The pipeline engine on one GPU: the byte GPT as a one-stage PipelineModule
(examples/gpt_pipe.py) trained with `train_batch` under each schedule that
runs on one stage, beside the data-parallel engine on the same weights and
batches (same global batch: `gradient_accumulation_steps` micro-batches).

    python bench/gpu/pipeline_check.py [--model 82m] [--steps 6] [--warmup 2] [--device cuda]

One rank only (a second NCCL rank cannot share the GPU), so this checks the
executor, the strategy seams and the zero-bubble split backward on the
device, not the sends between stages. Prints a table (median ms per step,
peak MiB, first and last loss) and exits non-zero when a run fails, a loss
is not finite, or a schedule's first loss is more than 0.02 from the
data-parallel engine's. `--run dp|1f1b|zb-h1` runs one of them in this
process and prints its `RESULT {json}` line (as gpt_case.py does: median and
minimum ms per step, peak MiB, the losses), which is how gpu_check.py runs
the pipeline rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"tiny": (2, 64, 4, 64, 2), "82m": (12, 768, 12, 1024, 8)}  # layers, width, heads, seq, micro
MICRO_BATCHES = 4


def run_one(args) -> dict:
    """One configuration in this process; returns its record."""
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import dsrun
    from gpt_model import GPT, GPTConfig
    from gpt_pipe import gpt_pipeline, load_gpt_weights, lm_loss

    layers, width, heads, seq, micro = MODELS[args.model]
    cfg = GPTConfig(vocab_size=256, seq_len=seq, n_layer=layers, n_embd=width, n_head=heads, dropout=0.0)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": MICRO_BATCHES,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10**9}
    g = torch.Generator().manual_seed(1)
    batches = [[(torch.randint(0, 256, (micro, seq), generator=g), torch.randint(0, 256, (micro, seq), generator=g))
                for _ in range(MICRO_BATCHES)] for _ in range(args.steps + args.warmup)]
    if args.run == "dp":
        engine, *_ = dsrun.initialize(model=gpt, config=config)

        def step(micro_batches):
            total = 0.0
            for x, y in micro_batches:
                loss = lm_loss(engine(x.to(engine.device)), y.to(engine.device))
                engine.backward(loss)
                engine.step()
                total += float(loss) / MICRO_BATCHES
            return total
    else:
        pipe = gpt_pipeline(cfg, 1)
        load_gpt_weights(pipe, gpt)
        config["pipeline"] = {"schedule": args.run}
        engine, *_ = dsrun.initialize(model=pipe, config=config)

        def step(micro_batches):
            return float(engine.train_batch(iter(micro_batches)))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i, micro_batches in enumerate(batches):
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(step(micro_batches))
        if args.device == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1000)
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else 0.0
    return {"model": args.model, "run": args.run, "arch": "pipe", "step_ms_median": statistics.median(times),
            "step_ms_min": min(times), "peak_mib": peak, "losses": losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="82m", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--run", choices=["dp", "1f1b", "zb-h1"], help="run one configuration here (RESULT line)")
    args = parser.parse_args()
    if args.run:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    rows, failed = [], False
    for run in ("dp", "1f1b", "zb-h1"):
        proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                               "--warmup", str(args.warmup), "--device", args.device, "--run", run],
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(f"{run}: FAILED\n{proc.stderr[-3000:]}")
            failed = True
            continue
        rows.append(json.loads(line[len("RESULT "):]))
    base = rows[0]["losses"][0] if rows and rows[0]["run"] == "dp" else None
    print(f"| run ({args.model}, {MICRO_BATCHES} micro-batches, bf16, ZeRO-1) | median ms | min ms | peak MiB "
          "| first loss | last loss |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['step_ms_median']:.1f} | {r['step_ms_min']:.1f} | {r['peak_mib']:,.0f} "
              f"| {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |")
        finite = all(v == v and abs(v) < 1e4 for v in r["losses"])
        if not finite or (base is not None and abs(r["losses"][0] - base) > 0.02):
            print(f"{r['run']}: FAIL (losses {r['losses']})")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

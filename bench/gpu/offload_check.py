"""ZeRO-Offload and parameter offload on one GPU: step time, peak GPU memory, losses, the offload timeline.

    python bench/gpu/offload_check.py                       # 1.2B GPT: s2 and s2-offload (gpu_check.py has the rest)
    python bench/gpu/offload_check.py --small               # 4 x 256 GPT, a quick check
    python bench/gpu/offload_check.py --configs s2-offload --steps 8
    python bench/gpu/offload_check.py --device cpu --small  # smoke test without a GPU

World size 1 (RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1, MASTER_PORT set
here when missing), NCCL on CUDA, gloo with --device cpu. The model is
examples/gpt_model.py's GPT (default 24 x 2048, 16 heads, seq 1024,
vocab 256: 1.21B parameters; micro-batch 4, bf16), built on the device.
Configurations (--configs, comma-separated):

- s2: stage 2, no offload (the reference for the losses);
- s2-offload: stage 2 + offload_optimizer cpu (ZeRO-Offload: the issue's
  DeepSpeed 0.19.8 figures on one H100 are 668.5 ms and 9,696 MiB);
- s3-param-cpu: stage 3 + offload_param cpu;
- s3-param-nvme: stage 3 + offload_param nvme under --nvme_path.

Each runs in its own process (so one run's GPU memory cannot count in the
next one's peak), --warmup + --steps steps on one fixed batch (so the loss
must fall), and prints the median step time (ms, between CUDA
synchronizations), the peak GPU memory over the training steps
(torch.cuda.max_memory_allocated, MiB, reset after dsrun.initialize; the
construction's own peak beside it), the losses and, for optimizer offload,
the last step's offload timeline (engine.offload_timeline()). It exits 1 when a
config raises, a loss is not finite, the loss does not fall, or an
offloaded run's first loss differs from s2's (the same model and batch)
by more than --loss_rtol or its last one by more than --last_loss_rtol
(GPU Adam there, CPU Adam here: equal up to rounding). The CPU Adam op is built first (its build time is
printed); without it the check fails, since the PyTorch fallback is not
what is being measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

CONFIGS = ("s2", "s2-offload", "s3-param-cpu", "s3-param-nvme")


def _zero(name: str, args) -> dict:
    zero = {"reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket}
    if name == "s2":
        return {"stage": 2, **zero}
    if name == "s2-offload":
        return {"stage": 2, **zero, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if name == "s3-param-cpu":
        return {"stage": 3, **zero, "offload_param": {"device": "cpu", "pin_memory": True}}
    if name == "s3-param-nvme":
        if not args.nvme_path:
            raise SystemExit("s3-param-nvme needs --nvme_path (an existing directory on a local NVMe drive)")
        return {"stage": 3, **zero, "offload_param": {"device": "nvme", "nvme_path": args.nvme_path,
                                                      "buffer_count": 4}}
    raise SystemExit(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(name: str, args, device: torch.device) -> dict:
    """Build, train and measure one configuration; returns its figures."""
    import dsrun
    from examples.gpt_model import GPT, GPTConfig

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 10**9, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1}},
           "zero_optimization": _zero(name, args)}
    torch.manual_seed(0)
    shape = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                      n_embd=args.n_embd)
    with torch.device(device):
        model = GPT(shape)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.param_groups(), config=cfg)
    build_s = time.perf_counter() - t0
    if device.type == "cuda":
        build_peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)  # from here: the training steps' own peak
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, args.vocab, (args.micro, args.seq_len + 1), generator=g).to(device)
    x, y = batch[:, :-1], batch[:, 1:]
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        _sync(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    timeline = engine.offload_timeline()
    out = {"name": name, "params": n_params, "build_s": build_s, "step_ms": statistics.median(times),
           "min_ms": min(times), "losses": losses, "timeline": timeline,
           "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
           "build_peak_mib": build_peak if device.type == "cuda" else None}
    for tier in (engine.strategy.optimizer_tier, engine.strategy.param_tier):
        tier.close()
    del engine, model
    return out


def check(results: list[dict], rtol: float, last_rtol: float) -> list[str]:
    """What is wrong with the runs (empty: all good)."""
    problems = []
    ref = next((r for r in results if r["name"] == "s2" and "error" not in r), None)
    for r in results:
        if "error" in r:
            problems.append(f"{r['name']}: raised {r['error']}")
            continue
        if not all(math.isfinite(v) for v in r["losses"]):
            problems.append(f"{r['name']}: non-finite loss {r['losses']}")
        elif r["losses"][-1] >= r["losses"][0]:
            problems.append(f"{r['name']}: the loss did not fall ({r['losses'][0]:.4f} -> {r['losses'][-1]:.4f})")
        if ref is None or r is ref:
            continue
        for at, tol in ((0, rtol), (-1, last_rtol)):  # the same forward; then the same updates, up to rounding
            if abs(r["losses"][at] - ref["losses"][at]) > tol * abs(ref["losses"][at]):
                problems.append(f"{r['name']}: {'first' if at == 0 else 'last'} loss {r['losses'][at]:.6f} "
                                f"differs from s2's {ref['losses'][at]:.6f} by more than {tol:g} (relative)")
    return problems


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one(name: str, args) -> int:
    """Child process: run config `name`, print its figures as one JSON line."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)
    from dsrun.runtime.distributed.dist import init_distributed

    device = init_distributed("nccl" if args.device == "cuda" else "gloo").device
    try:
        r = run_config(name, args, device)
    except Exception as e:  # reported as this config's failure
        traceback.print_exc()
        r = {"name": name, "error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(r), flush=True)
    return 0


def _spawn(name: str, argv: list[str]) -> dict:
    """Run config `name` in a fresh process; its figures, or its failure."""
    proc = subprocess.run([sys.executable, __file__, *argv, "--one", name], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        return {"name": name, "error": f"the run exited with code {proc.returncode} without a result"}
    if proc.returncode or "error" in lines[-1]:
        sys.stderr.write(proc.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    from dsrun.runtime.offload.transfer import format_timeline

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="s2,s2-offload",
                   help=f"comma-separated, from {', '.join(CONFIGS)} (s3-param-nvme needs --nvme_path)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--n_layer", type=int, default=24)
    p.add_argument("--n_embd", type=int, default=2048)
    p.add_argument("--n_head", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--small", action="store_true", help="4 layers x 256, 4 heads, seq 256 (overrides the shape)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--bucket", type=int, default=500_000_000, help="reduce/allgather bucket elements")
    p.add_argument("--nvme_path", default=None)
    p.add_argument("--loss_rtol", type=float, default=1e-2, help="first loss vs s2's (relative)")
    p.add_argument("--last_loss_rtol", type=float, default=5e-2, help="last loss vs s2's (relative)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: the child running one config
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup + args.steps < 2:
        p.error("--steps >= 1 and --warmup + --steps >= 2 (the loss must fall between the first and the last)")
    if args.small:
        args.n_layer, args.n_embd, args.n_head, args.seq_len = 4, 256, 4, 256
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; pass --device cpu for the smoke test")
    if args.one:
        return _one(args.one, args)
    from dsrun.ops import adam as native_adam

    t0 = time.perf_counter()
    if not native_adam.native_available():
        print("FAIL: dsrun's CPU Adam op did not build (see dsrun-report); the check measures the native op")
        return 1
    print(f"CPU Adam op ready in {time.perf_counter() - t0:.1f} s (ISA {native_adam.selected_isa()}, "
          f"{torch.get_num_threads()} threads)")
    print(f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f", GPT {args.n_layer} x {args.n_embd}, seq {args.seq_len}, micro {args.micro}, bf16")
    results = []
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        _zero(name, args)  # an unknown name or a missing --nvme_path stops here, before any run
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        r = _spawn(name, argv)
        results.append(r)
        if "error" not in r:
            peak = (f"{r['peak_mib']:,.0f} MiB (construction {r['build_peak_mib']:,.0f})"
                    if r["peak_mib"] is not None else "n/a")
            print(f"{name:<14} {r['params'] / 1e6:8.1f}M params  step {r['step_ms']:8.1f} ms (min {r['min_ms']:.1f})"
                  f"  peak GPU {peak}  built in {r['build_s']:.1f} s")
            print(f"{'':<14} losses {' '.join(f'{v:.4f}' for v in r['losses'])}")
            if r["timeline"]:
                print(format_timeline(r["timeline"]))
    problems = check(results, args.loss_rtol, args.last_loss_rtol)
    for line in problems:
        print("FAIL:", line)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

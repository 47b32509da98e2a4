"""CPU Adam step time: dsrun's kernel vs torch.optim.Adam(fused=True), one run.

    .venv/bin/python bench/ops/bench_cpu_adam.py [--numel 100000000] [--threads 2] [--repeats 7]

Cases (all on the same machine, interleaved round by round so drift hits all):
  torch fused fp32          torch.optim.Adam(fused=True) on fp32 params (baseline)
  dsrun fp32                dsrun.ops.adam.adam_step, fp32 params/grads/states
  torch fused fp32 + bf16 copy   the torch way to get dsrun's bf16 result: step, then .copy_ to bf16
  torch fused bf16 params   torch fused Adam on bf16 params (its states are bf16 too)
  dsrun fp32 + bf16 copy    fp32 master/states, bf16 copy written in the same pass
  dsrun fp32 + fp16 copy    the same with an fp16 copy
  dsrun bf16 grad + bf16 copy    bf16 gradients read, fp32 master/states, bf16 copy
  dsrun fallback + bf16 copy  the pure-PyTorch fallback (torch's fused step, then the copy)
With --deepspeed DIR (a directory holding the deepspeed package, e.g. from
`pip install --target DIR deepspeed`), DeepSpeedCPUAdam runs in the same
rounds: fp32 params, and bf16 params with fp32 states (its first use JIT-builds
its op, about 50 s). Without it, REFERENCE.md's figures for this kind of
machine are 63 ms (fp32) and 182-184 ms (bf16).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import table  # noqa: E402

from dsrun.ops import adam  # noqa: E402


def deepspeed_cases(path: str, n: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, path)
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    cases = {}
    for label, dtype in (("deepspeed cpu_adam fp32", torch.float32), ("deepspeed cpu_adam bf16 params", torch.bfloat16)):
        p = torch.nn.Parameter(torch.randn(n).to(dtype))
        p.grad = torch.randn(n).to(dtype)
        opt = DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=True, fp32_optimizer_states=True)
        cases[label] = opt.step
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--deepspeed", metavar="DIR", help="also time DeepSpeedCPUAdam, imported from DIR")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert adam.native_available(), "the native CPU Adam did not build"
    n = args.numel
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    copy_bf16, copy_f16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.float16)
    g_bf16 = g.to(torch.bfloat16)
    tp = torch.nn.Parameter(torch.randn(n))
    tp.grad = torch.randn(n)
    topt = torch.optim.Adam([tp], lr=1e-3, fused=True)
    tb = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
    tb.grad = torch.randn(n).to(torch.bfloat16)
    topt_b = torch.optim.Adam([tb], lr=1e-3, fused=True)
    step = [0]

    def ours(grad, copy):
        def run():
            step[0] += 1
            adam.adam_step(p, grad, m, v, step=step[0], lr=1e-3, param_copy=copy)
        return run

    def fallback():
        step[0] += 1
        adam._adam_step_torch(p, g, m, v, step=step[0], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.0, adamw_mode=True, bias_correction=True, grad_scale=1.0,
                              param_copy=copy_bf16)

    def torch_then_copy():
        topt.step()
        copy_bf16.copy_(tp.detach())

    cases = {
        "torch fused fp32": topt.step,
        "dsrun fp32": ours(g, None),
        "torch fused fp32 + bf16 copy": torch_then_copy,
        "torch fused bf16 params": topt_b.step,
        "dsrun fp32 + bf16 copy": ours(g, copy_bf16),
        "dsrun fp32 + fp16 copy": ours(g, copy_f16),
        "dsrun bf16 grad + bf16 copy": ours(g_bf16, copy_bf16),
        "dsrun fallback + bf16 copy": fallback,
    }
    if args.deepspeed:
        cases.update(deepspeed_cases(args.deepspeed, n))
    for fn in cases.values():  # warm up: first touch of states, thread pools
        fn()
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    print(table(f"Adam step, {n / 1e6:.0f}M parameters, {args.threads} threads, ISA {adam.selected_isa()}",
                list(samples.items()), baseline="torch fused fp32"))


if __name__ == "__main__":
    main()

"""Ulysses sequence parallelism of the byte GPT: the longest sequence that
trains within a fixed activation-memory budget per rank at P = 1, 2, 4,
the step time, and the all-to-all bytes per layer beside the analytic
counts.

    .venv/bin/python bench/sequence/ulysses.py [--budget-mib 48] [--sizes 1 2 4] [--start 512]

Model: examples/gpt_model.py's GPT (bytes: vocab 256), `--n_layer` layers
of width `--n_embd` with `--n_head` heads, fp32, micro-batch 1, AdamW,
ZeRO stage 1, one torch thread per rank, gloo on the CPU. P = 1 is the
plain GPT on one rank; P > 1 is examples/gpt_sequence.py on P ranks
(sequence=P x data=1, `initialize(mesh_param=(1, P))`): each rank holds
N/P tokens, attention runs on all N tokens of n_head/P heads.

For each P the sequence length N doubles from `--start` until one step's
activations exceed the budget on a rank; each length is one warm-up step
and one measured step:

  saved     bytes of the tensors autograd saved for backward during the
            forward on rank 0 (torch.autograd.graph.saved_tensors_hooks,
            each storage once, the parameters' own storages left out): the
            activation memory of the step, exact;
  peak      rank 0's peak RSS during forward + backward + step minus its
            RSS before (freed heap returned first with malloc_trim, VmHWM
            reset through /proc/self/clear_refs): what the machine
            provided, allocator, gradients and the all-to-all buffers
            included; noisy;
  step      forward + backward + optimizer step, wall seconds on rank 0
            (after a barrier);
  a2a/layer bytes of all_to_all_single counted by the comms logger during
            one forward on rank 0, divided by the layers (the message
            tensors, as DeepSpeed's comms logger counts them).

Analytic counts per layer and forward (Jacobs et al. 2023, "DeepSpeed
Ulysses", arXiv 2309.14509, Section 3.2), b = 1, h = n_embd, fp32:
Ulysses sends q, k, v and the output, each N/P tokens x h, per rank:
4 N h / P elements (the logger counts the whole message, of which 1/P
stays on the rank). Megatron-LM's sequence parallelism all-gathers and
reduce-scatters N x h activations around attention and MLP: 4 N h elements
per rank per layer in forward whatever P is (the same paper's count;
dsrun has no Megatron-SP transformer to measure it with, so the column is
the formula only).

The longest length is reported as the longest doubling that fits and as
budget / (saved bytes per token at that length): activations grow
linearly in N/P (CPU sdpa keeps O(N) per head: no N x N matrix), so the
second column estimates the exact limit.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def _rss() -> tuple[int, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            fields[line[:5]] = int(line.split()[1]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _measure(sequence: int, args: argparse.Namespace) -> list[dict]:
    """On every rank of a P-rank job: train one step per length until the
    budget is passed; rank 0's measurements."""
    import torch
    import torch.distributed as dist

    import dsrun
    from dsrun.runtime.comm import comms_logger
    from dsrun.runtime.memory import allocator
    from gpt_model import GPT, GPTConfig  # examples/
    from gpt_sequence import sequence_parallel_gpt

    torch.set_num_threads(1)
    dsrun.init_distributed()
    longest = args.start * 2 ** 6  # the position table caps the search
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=longest, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    if sequence > 1:
        model = sequence_parallel_gpt(model, sequence)
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}}
    engine, *_ = dsrun.initialize(model=model, config=config,
                                  **({"mesh_param": (1, sequence)} if sequence > 1 else {}))
    budget = args.budget_mib * 2 ** 20
    rows, length = [], args.start
    while length <= longest:
        x = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
        y = torch.roll(x, -1, dims=1)
        engine.backward(engine(x, y))  # warm-up
        engine.step()
        seen: dict[int, int] = {}
        weights = {q.untyped_storage().data_ptr() for q in engine.module.parameters()}

        def pack(t, seen=seen, weights=weights):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:  # a layer keeps its weight for backward: not an activation
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        dist.barrier()
        gc.collect()
        allocator.trim()  # the warm-up's freed heap back to the kernel, so that RSS grows again
        before, _ = _rss()
        Path("/proc/self/clear_refs").write_text("5")
        comms_logger.reset()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = engine(x, y)
        forward = comms_logger.snapshot().get("all_to_all_single")
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - start
        _, peak = _rss()
        saved = sum(seen.values())
        rows.append({"P": sequence, "N": length, "saved": saved, "peak": peak - before, "step": seconds,
                     "a2a": (forward.bytes if forward else 0) / args.n_layer, "loss": float(loss.detach())})
        verdict = torch.tensor([float(saved > budget)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # every rank stops at the same length
        if verdict.item():
            break
        length *= 2
    engine.destroy()
    return rows


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-mib", type=float, default=48.0, help="activation bytes allowed per rank (MiB)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel degrees P")
    p.add_argument("--start", type=int, default=512, help="first sequence length (doubled each try)")
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    args = p.parse_args()
    from tests.dist_helpers import run_ranks

    h = args.n_embd
    print(f"GPT: {args.n_layer} layers, width {h}, {args.n_head} heads, vocab 256, fp32, micro-batch 1; "
          f"budget {args.budget_mib:g} MiB of saved activations per rank\n")
    print("| P | N | saved MiB/rank | saved bytes/token | peak RSS MiB/rank | step s | a2a bytes/layer | "
          "4Nh/P x 4 B | Megatron-SP 4Nh x 4 B | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    for sequence in args.sizes:
        rows = run_ranks(_measure, sequence, sequence, args, timeout=3000)[0]
        fitting = [r for r in rows if r["saved"] <= args.budget_mib * 2 ** 20]
        for r in rows:
            n = r["N"]
            print(f"| {r['P']} | {n} | {_mib(r['saved'])} | {r['saved'] / (n / sequence):,.0f} | "
                  f"{_mib(r['peak'])} | {r['step']:.2f} | {r['a2a']:,.0f} | "
                  f"{(4 * n * h // sequence * 4) if sequence > 1 else 0:,} | {4 * n * h * 4:,} | "
                  f"{'yes' if r in fitting else 'no'} |", flush=True)
        last = fitting[-1] if fitting else rows[0]
        estimate = args.budget_mib * 2 ** 20 / (last["saved"] / last["N"])
        summary.append((sequence, fitting[-1]["N"] if fitting else 0, estimate, last["step"]))
    print("\n| P | longest doubling within budget | budget / (saved bytes per token) | step s there |")
    print("|---|---|---|---|")
    for sequence, n, estimate, step in summary:
        print(f"| {sequence} | {n} | {estimate:,.0f} | {step:.2f} |")


if __name__ == "__main__":
    main()

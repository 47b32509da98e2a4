"""Activation memory of the 48M GPT with and without dsrun.checkpointing.

    .venv/bin/python bench/memory/activation_checkpointing.py [--seq 1024] [--batch 1] [--repeats 3]

Model: examples/gpt_model.py with REFERENCE.md §6's 48M shape (d=512, 10
layers, 8 heads, vocab 32000, tied head), fp32, one process on the CPU,
1 torch thread. Each measurement is a fresh process (this file with
--worker) that builds the model, runs one warm-up step, then measures one
forward+backward of a (batch, seq) batch:
  saved      bytes of the tensors autograd saved for backward during the
             forward (torch.autograd.graph.saved_tensors_hooks, counted once
             per storage): the activation memory itself, exact;
  peak       the process's peak RSS during forward+backward minus its RSS
             right before the forward (VmHWM reset through /proc/self/clear_refs):
             what the machine had to provide, allocator and gradients included;
  time       forward+backward seconds.
"plain" runs the blocks as they are; "checkpointed" wraps each block in
dsrun.checkpointing.checkpoint (non-reentrant torch checkpoint: each
block's input is kept, its inside recomputed in backward). The two are
interleaved (plain, checkpointed, plain, ...) over --repeats and reported
as median [min-max], with the ratio checkpointed/plain of the medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rss() -> tuple[int, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            fields[line[:5]] = int(line.split()[1]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def worker(args: argparse.Namespace) -> None:
    import torch
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT))
    from gpt_model import GPT, GPTConfig

    import dsrun as deepspeed
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32000, seq_len=args.seq, n_layer=10, n_head=8, n_embd=512))
    idx = torch.randint(0, 32000, (args.batch, args.seq))
    tgt = torch.randint(0, 32000, (args.batch, args.seq))

    def loss_of() -> torch.Tensor:
        pos = torch.arange(args.seq)
        x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
        for block in model.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if args.mode == "checkpointed" else block(x)
        logits = model.head(model.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))

    loss_of().backward()  # warm-up: allocator pools, gradient buffers
    model.zero_grad(set_to_none=False)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    before, _ = _rss()
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of()
    loss.backward()
    seconds = time.perf_counter() - start
    _, peak = _rss()
    print(json.dumps({"saved": sum(seen.values()), "peak": peak - before, "seconds": seconds,
                      "loss": loss.item()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["plain", "checkpointed"], default="plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs: dict[str, list[dict]] = {"plain": [], "checkpointed": []}
    for _ in range(args.repeats):
        for mode in runs:
            out = subprocess.run([sys.executable, __file__, "--worker", "--mode", mode, "--seq", str(args.seq),
                                  "--batch", str(args.batch)], capture_output=True, text=True, check=True,
                                 env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = 2 ** 20
    print(f"48M GPT (d=512, 10 layers, vocab 32000), batch {args.batch} x seq {args.seq}, fp32, 1 thread, "
          f"{args.repeats} repeats, median [min-max]")
    print(f"{'run':<13} {'saved MiB':>22} {'peak MiB':>24} {'fwd+bwd s':>20}")
    medians = {}
    for mode, rows in runs.items():
        cols = []
        for key, scale in (("saved", mib), ("peak", mib), ("seconds", 1)):
            values = [r[key] / scale for r in rows]
            medians[(mode, key)] = statistics.median(values)
            cols.append(f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]")
        print(f"{mode:<13} {cols[0]:>22} {cols[1]:>24} {cols[2]:>20}")
    ratio = {k: medians[("checkpointed", k)] / medians[("plain", k)] for k in ("saved", "peak", "seconds")}
    print(f"checkpointed / plain: saved {ratio['saved']:.3f}, peak {ratio['peak']:.3f}, "
          f"time {ratio['seconds']:.2f}")
    assert runs["plain"][0]["loss"] == runs["checkpointed"][0]["loss"], "the two runs computed different losses"


if __name__ == "__main__":
    main()

"""Step time of the 48M-parameter GPT of REFERENCE.md §6 under DDP, FSDP2 and
dsrun ZeRO stages 0-3, measured side by side in one run.

    .venv/bin/python bench/step_time/gpt_step.py [--warmup 2] [--steps 5] [--launches 1]

Model: d=512, 10 layers, 8 heads, vocab 32000, seq 256, micro-batch 2, tied
embedding/head (47.9M parameters), fp32, AdamW; 2 ranks on gloo, 1 torch
thread each. Each configuration runs in a fresh pair of processes (so peak
RSS is its own); a step is forward + backward + optimizer step, timed
between barriers. Reported: median seconds per step over all timed steps
of all launches, spread (min-max), ratio of the median to DDP's, and each
rank's peak RSS (ru_maxrss).
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn
from torch.nn import functional as F

RUNS = ("ddp", "fsdp2", "dsrun-0", "dsrun-1", "dsrun-2", "dsrun-3")
D, LAYERS, HEADS, VOCAB, SEQ, MICRO = 512, 10, 8, 32000, 256, 2
BUCKET = 5_000_000


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def _rank(run: str, rank: int, port: int, warmup: int, steps: int, out: "mp.Queue") -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    torch.manual_seed(0)
    model = GPT()
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g) for _ in range(warmup + steps)]
    if run.startswith("dsrun"):
        import dsrun

        stage = int(run.split("-")[1])
        engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config={"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
                                              # 5e6 elements = 20 MB fp32 buckets, as DDP's 25 MB:
                                              # several buckets overlap with backward.
                                              "zero_optimization": {"stage": stage,
                                                                    "reduce_bucket_size": BUCKET,
                                                                    "allgather_bucket_size": BUCKET},
                                              "steps_per_print": 10**9})

        def step(batch):
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
    else:
        dist.init_process_group("gloo")
        if run == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.h:
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(batch):
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    times = []
    for i, batch in enumerate(data):
        dist.barrier()
        t0 = time.perf_counter()
        step(batch)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put((rank, times, rss_mib))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run: str, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(run, r, port, warmup, steps, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{run}: a rank exited with code {dead[0]} (traceback above)")
    results.sort()
    for p in procs:
        p.join()
    times = [max(a, b) for a, b in zip(results[0][1], results[1][1])]
    return times, [r[2] for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--launches", type=int, default=1)
    ap.add_argument("--runs", default=",".join(RUNS))
    args = ap.parse_args()
    rows = {}
    for run in args.runs.split(","):
        times, rss = [], []
        for _ in range(args.launches):
            t, r = launch(run, args.warmup, args.steps)
            times += t
            rss = [max(a, b) for a, b in zip(rss, r)] if rss else r
        rows[run] = (times, rss)
        print(f"{run}: {statistics.median(times):.3f} s/step", file=sys.stderr, flush=True)
    base = statistics.median(rows["ddp"][0]) if "ddp" in rows else math.nan
    print(f"\n48M GPT, 2 ranks x 1 thread, gloo, fp32; {args.launches} launch(es) x "
          f"{args.steps} timed steps after {args.warmup} warm-up\n")
    print("| run | median s/step | spread (min-max) | vs DDP | peak RSS rank0/rank1 (MiB) |")
    print("|---|---|---|---|---|")
    for run, (times, rss) in rows.items():
        med = statistics.median(times)
        print(f"| {run} | {med:.3f} | {min(times):.3f}-{max(times):.3f} | {med / base:.2f} | "
              f"{rss[0]:.0f} / {rss[1]:.0f} |")


if __name__ == "__main__":
    main()

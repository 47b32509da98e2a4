"""engine.compile() against eager mode: the training step at ZeRO stages 0-3 on CPU.

    .venv/bin/python bench/compile/compile_step.py [--stages 0,3] [--backend inductor] [--repeats 10]

2 gloo ranks, one torch thread each, fp32. Per stage, both ranks build two
engines from the same seed, one eager and one compiled with `--backend`;
each runs `--warmup` steps (the compiled one compiles there), then the two
alternate, one optimizer step each (eager, compiled, eager, ...) for
`--repeats` cycles, with a barrier before every timed step. Prints per
stage: the median and min-max of each, the compiled/eager ratio of the
medians and the min/median/max of the per-cycle ratios, the compile time
(the first step's time minus a warm step's), the losses of the last step
(equal to ~1e-6 relative: inductor's fused kernels round differently) and
the graph breaks (graph_breaks(); stage 3: the root's calls into its
units, see [Note: compiling under ZeRO hooks] in dsrun/runtime/engine/compile.py).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _model(width: int, layers: int, vocab: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(width)
            self.fc = nn.Linear(width, 4 * width)
            self.proj = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.proj(nn.functional.gelu(self.fc(self.ln(x))))

    class Net(nn.Module):
        """Token embedding, `layers` residual MLP blocks (the stage-3 units), norm, head."""

        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, width)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, idx, targets):
            x = self.wte(idx)
            for block in self.h:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return nn.functional.cross_entropy(logits.view(-1, vocab), targets.view(-1))

    torch.manual_seed(0)
    return Net()


def _rank(rank, port, args, out):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch._dynamo

    torch.set_num_threads(1)
    import dsrun
    from dsrun.runtime import comm
    from dsrun.runtime.engine.compile import graph_breaks

    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    tgt = torch.roll(idx, -1, 1)
    results = {}
    for stage in args.stages:
        torch._dynamo.reset()
        cfg = {"train_micro_batch_size_per_gpu": args.batch, "steps_per_print": 10**9,
               "zero_optimization": {"stage": stage}}
        engines = {}
        for name in ("eager", "compiled"):
            model = _model(args.width, args.layers, args.vocab)
            engines[name], *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                                 config=cfg)
        engines["compiled"].compile(backend=args.backend)

        def step(name):
            comm.barrier()
            t0 = time.perf_counter()
            loss = engines[name](idx, tgt)
            engines[name].backward(loss)
            engines[name].step()
            return time.perf_counter() - t0, loss.item()

        first = {name: step(name)[0] for name in engines}
        for _ in range(args.warmup - 1):
            for name in engines:
                step(name)
        times = {name: [] for name in engines}
        losses = {}
        for _ in range(args.repeats):
            for name in engines:
                t, losses[name] = step(name)
                times[name].append(t)
        results[stage] = {"times": times, "losses": losses, "breaks": graph_breaks(),
                          "compile_s": first["compiled"] - statistics.median(times["compiled"])}
        for engine in engines.values():
            engine.destroy()
    if rank == 0:
        out.put(results)
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    args.stages = [int(s) for s in args.stages.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    res = out.get(timeout=3600)
    for p in procs:
        p.join()
    print(f"2 gloo ranks x 1 thread, fp32, width {args.width}, {args.layers} blocks, vocab {args.vocab}, "
          f"micro-batch {args.batch} x seq {args.seq}, backend {args.backend}, {args.repeats} interleaved "
          f"cycles after {args.warmup} warm-up steps\ncommand: {' '.join(sys.argv)}\n")
    print("| stage | eager ms median (min-max) | compiled ms median (min-max) | compiled/eager median "
          "| per-cycle ratio min / median / max | compile s | last loss eager / compiled |")
    print("|---|---|---|---|---|---|---|")
    for stage, r in res.items():
        e, c = r["times"]["eager"], r["times"]["compiled"]
        ratios = sorted(ci / ei for ei, ci in zip(e, c))
        fmt = lambda ts: f"{statistics.median(ts) * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"
        print(f"| {stage} | {fmt(e)} | {fmt(c)} | {statistics.median(c) / statistics.median(e):.2f} | "
              f"{ratios[0]:.2f} / {statistics.median(ratios):.2f} / {ratios[-1]:.2f} | {r['compile_s']:.1f} | "
              f"{r['losses']['eager']:.6f} / {r['losses']['compiled']:.6f} |")
    for stage, r in res.items():
        print(f"\nstage {stage} graph breaks: " + ("none" if not r["breaks"] else ""))
        for reason, count in r["breaks"].items():
            print(f"  {count} x {reason}")


if __name__ == "__main__":
    main()

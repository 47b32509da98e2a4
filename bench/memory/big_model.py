"""A model whose DDP model states do not fit this machine trains under dsrun
ZeRO stage 3 on 2 ranks.

    .venv/bin/python bench/memory/big_model.py [--layers 64] [--width 4096] [--steps 3] [--lr 1e-5]

Default model: 64 x nn.Linear(4096, 4096) = 1.07B parameters (Ψ). In fp32
with Adam (4 + 4 + 8 bytes per parameter), DDP holds 16Ψ = 16.0 GiB per
rank, 32 GiB for its 2 ranks, against 24 GiB of RAM here; ZeRO stage 3
holds 16Ψ/N = 8.0 GiB per rank (N = 2), 16 GiB for both. Both ranks run on
this one machine, so stage 3 cannot make their sum smaller than 16Ψ: a
1.61B model (96 layers) would need 2 x 12 GiB, all of the RAM, and does not
fit here (it does on two machines, or with N ranks on N machines).

The model is built inside `with dsrun.zero.Init():` (no rank ever holds it
whole), wrapped by `dsrun.initialize` with zero_optimization stage 3 (the
knobs of peak_memory.py) and fp32 AdamW, then trained for --steps steps on
a fixed regression target: each layer but the last is followed by a
parameter-free RMS normalisation (so the deep linear chain neither explodes
nor vanishes) and the last layer's output is fitted to fixed random targets
by MSE, so the loss goes down. Per step it prints the loss (mean over
ranks) and each rank's peak RSS above its RSS before the model was built
(VmHWM reset through /proc/self/clear_refs, as in peak_memory.py); at the
end, the peak against 16Ψ/N from dsrun.estimate_zero_memory. The ranks are
fresh processes (gloo on CPU, 1 torch thread each); a guard stops them when
their RSS together passes --rss-limit-gib (default 21).

`--layers 4 --width 1024` is a quick check. Run the full size only on an
otherwise idle machine: it needs 16 GiB plus slack.

`--nvme DIR` puts the optimizer states and the parameter partitions in swap
files under DIR (offload_optimizer and offload_param, device nvme), so the
model states may exceed the machine's RAM: `--layers 104` (1.75B
parameters, 16Ψ = 26 GiB of fp32 Adam states against 24 GiB of RAM) trains
with each rank's RSS far below 16Ψ/N. The table then shows the swap-file
bytes per rank beside the estimator's device / host / NVMe split. DIR needs
16Ψ bytes free; the files are deleted at exit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_memory import (MIB, MICRO, WORLD, Stack, ds_config, format_table, launch,  # noqa: E402
                         mem_total_gib, num_params, status_kib)

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

GIB = 2 ** 30


class NormStack(Stack):
    """Stack whose hidden activations are RMS-normalised after every layer but the last."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """MSE between the last layer's output and y; x is normalised after each earlier layer."""
        for layer in self.layers[:-1]:
            x = layer(x)
            x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        return F.mse_loss(self.layers[-1](x), y)


def worker(args: argparse.Namespace) -> None:
    """One rank: baseline RSS, build under zero.Init, stage-3 engine, train; PROGRESS and RESULT lines."""
    torch.set_num_threads(1)
    import dsrun
    import torch.distributed as dist

    dsrun.init_distributed()
    rank = dist.get_rank()
    cfg = ds_config(3, "fp32")
    cfg["optimizer"]["params"]["lr"] = args.lr
    if args.nvme:
        cfg["zero_optimization"].update(nvme_offload(args.nvme))
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = torch.randn(MICRO, args.width, generator=g), torch.randn(MICRO, args.width, generator=g)
    dist.barrier()

    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with dsrun.zero.Init():
        model = NormStack(args.layers, args.width)
    after_build = status_kib("VmRSS")
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    peaks = [status_kib("VmHWM") - before]
    if rank == 0:
        print(f"PROGRESS built and wrapped in {time.perf_counter() - t0:.0f} s; peak RSS so far "
              f"{peaks[0] / 1024:.0f} MiB (rank 0)", flush=True)
    losses = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / WORLD)
        peaks.append(status_kib("VmHWM") - before)
        both = [None] * WORLD
        dist.all_gather_object(both, peaks[-1])
        if rank == 0:
            print(f"PROGRESS step {i + 1}/{args.steps}: loss {losses[-1]:.4f}, peak RSS per rank "
                  + " / ".join(f"{p / 1024:.0f}" for p in both)
                  + f" MiB ({time.perf_counter() - t0:.1f} s)", flush=True)
    swap_bytes = engine.memory_breakdown().get("nvme_swap", {})
    dist.barrier()
    print("RESULT " + json.dumps({"rank": rank, "after_build_kib": after_build - before, "peaks_kib": peaks,
                                  "losses": losses, "swap_bytes": sum(swap_bytes.values())}), flush=True)
    dist.destroy_process_group()


def nvme_offload(path: str) -> dict:
    """zero_optimization keys that put optimizer states and parameters in swap files under `path`."""
    return {"sub_group_size": 10_000_000,
            "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 4},
            "offload_param": {"device": "nvme", "nvme_path": path, "buffer_count": 5}}


def main() -> None:
    """Parse options, launch the two ranks, print per-step losses and peaks and the formula."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    ap.add_argument("--rss-limit-gib", type=float, default=21.0,
                    help="stop the ranks when their RSS together passes this (default 21)")
    ap.add_argument("--nvme", metavar="DIR", help="offload optimizer states and parameters to swap files in DIR")
    ap.add_argument("--worker", metavar="RUN", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from dsrun import estimate_zero_memory

    psi = num_params(args.layers, args.width)
    with torch.device("meta"):
        meta = NormStack(args.layers, args.width)
    stage3 = estimate_zero_memory(meta, WORLD, 3, dtype="fp32").total / MIB
    offload = "nvme" if args.nvme else "none"
    tiers = estimate_zero_memory(meta, WORLD, 3, dtype="fp32", offload_optimizer=offload, offload_param=offload,
                                 sub_group_size=10_000_000).tiers()
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {psi / 1e6:.1f}M parameters (Ψ), fp32 AdamW "
          f"lr {args.lr:g}, {WORLD} ranks x 1 thread, gloo, CPU ({os.cpu_count()} cores, torch {torch.__version__})")
    print(f"DDP would hold 16Ψ = {16 * psi / GIB:.1f} GiB per rank, {WORLD * 16 * psi / GIB:.1f} GiB for "
          f"{WORLD} ranks; this machine has {mem_total_gib():.1f} GiB of RAM")
    print(f"ZeRO stage 3 formula 16Ψ/N = {stage3:.0f} MiB per rank (dsrun.estimate_zero_memory)", flush=True)
    if args.nvme:
        print("with optimizer and parameters on NVMe the estimator predicts per rank: "
              + ", ".join(f"{tier} {b / MIB:.0f} MiB" for tier, b in tiers.items()), flush=True)
    worker_args = ["--layers", str(args.layers), "--width", str(args.width), "--steps", str(args.steps),
                   "--lr", str(args.lr)] + (["--nvme", args.nvme] if args.nvme else [])
    t0 = time.perf_counter()
    out = launch(Path(__file__).resolve(), "dsrun-3-init", worker_args, None, args.rss_limit_gib, progress=True)
    if isinstance(out, str):
        sys.exit(f"big_model: {out} after {time.perf_counter() - t0:.0f} s")
    rows = [[f"step {i}" if i else "build+wrap", f"{out[0]['losses'][i - 1]:.4f}" if i else "-",
             *(f"{r['peaks_kib'][i] / 1024:.0f}" for r in out)] for i in range(args.steps + 1)]
    print()
    print(format_table(["", "loss", *(f"peak r{r['rank']} MiB" for r in out)], rows))
    peak = max(r["peaks_kib"][-1] for r in out) / 1024
    print("\nafter build under zero.Init: " + " / ".join(f"{r['after_build_kib'] / 1024:.0f}" for r in out)
          + " MiB per rank")
    print(f"peak RSS per rank {peak:.0f} MiB vs 16Ψ/N = {stage3:.0f} MiB: ratio {peak / stage3:.2f}; "
          f"loss {out[0]['losses'][0]:.4f} -> {out[0]['losses'][-1]:.4f}; {time.perf_counter() - t0:.0f} s in all")
    if args.nvme:
        print("swap files per rank: " + " / ".join(f"{r['swap_bytes'] / MIB:.0f}" for r in out)
              + f" MiB (estimator: {tiers['nvme'] / MIB:.0f} MiB on NVMe, {tiers['host'] / MIB:.0f} MiB host, "
              f"{tiers['device'] / MIB:.0f} MiB device)")


if __name__ == "__main__":
    main()

"""Mixture of Experts in the byte GPT: all-to-all bytes, dropped tokens, step time, validation loss.

    .venv/bin/python bench/moe/moe_gpt.py --steps 150 --runs dense,moe4,moe8

Each run trains examples/gpt_model.py's GPT on 2 gloo ranks (spawned by
tests/dist_helpers.run_ranks, 1 torch thread each) on the bytes of the
Python standard library (examples/byte_data.py: the same split, sampler
seeds and validation windows as train_gpt.py), fp32, AdamW (lr 3e-3,
constant), ZeRO stage 0, gradient clipping 1.0:

- `dense`: the GPT;
- `moeE`: examples/gpt_moe.py's MoEGPT, blocks 1, 3, ... with E experts
  (copies of the block's MLP) over ep_size 2 (E / 2 per rank), top-1
  gating, capacity factor 1.0, min_capacity 4, the loss plus 0.01 x l_aux.
  Top-1 sends each token through one expert MLP of the dense MLP's size, so
  its active parameters per token are the dense model's plus the gates
  (n_embd x E per MoE block).

Columns:
- all-to-all MB/step/rank: the comms logger's all_to_all_single bytes
  (message bytes, the whole tensor a rank passes) over the timed steps,
  divided by their number; analytic: per MoE layer and micro-batch four
  exchanges (dispatch and combine in forward, their gradients in
  backward) of E x C x n_embd fp32 values, C = max(ceil(S / E x 1.0), 4),
  S = micro-batch x seq tokens per rank;
- dropped %: per MoE layer, the token choices that found their expert full,
  over all steps and both ranks (the layers' ExpertLoad counts,
  dsrun/runtime/parallel/expert/load.py); then over the second half of the
  steps, per expert (layers separated by ";"): the percentage of its token
  choices dropped, and its share of the layer's tokens (1/E balanced);
- ms/step: the median over the timed steps (after `--warmup`) of rank 0's
  wall time per step;
- val loss: the mean cross-entropy (nats per byte) on `--eval_windows`
  held-out windows after training (ln 256 = 5.55 untrained).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from tests.dist_helpers import run_ranks  # noqa: E402


def _run(name: str, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    import dsrun
    from byte_data import WindowSampler, eval_windows, load_corpus
    from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from dsrun.runtime.comm import comms_logger
    from gpt_model import GPT, GPTConfig
    from gpt_moe import MoEGPT
    dsrun.init_distributed()
    rank = dist.get_rank()
    corpus = load_corpus(None, args["seq"])
    cfg = GPTConfig(seq_len=args["seq"], n_layer=args["layers"], n_head=4, n_embd=args["hidden"])
    torch.manual_seed(1234)
    experts = int(name[3:]) if name.startswith("moe") else 0
    model = MoEGPT(cfg, experts, ep_size=2, k=1) if experts else GPT(cfg)
    groups = model.param_groups()
    if experts:
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    engine, *_ = dsrun.initialize(model=model, model_parameters=groups, config={
        "train_micro_batch_size_per_gpu": args["micro"], "gradient_clipping": 1.0, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}})
    sampler = WindowSampler(corpus.train, args["seq"], seed=1234 * 100_003 + rank)
    times, half = [], None
    for step in range(args["steps"]):
        if step == args["warmup"]:
            comms_logger.reset()
        if step == args["steps"] // 2:  # the routing counts so far, to report the second half alone
            half = [(m.moe.deepspeed_moe.load.tokens.clone(), m.moe.deepspeed_moe.load.kept.clone())
                    for m in getattr(model, "moe_mlps", [])]
        x, y = sampler.sample(args["micro"])
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        times.append(time.perf_counter() - start)
    a2a = comms_logger.snapshot().get("all_to_all_single")
    timed = args["steps"] - args["warmup"]
    val_x, val_y = eval_windows(corpus.val, args["eval_windows"], args["seq"], 0)
    engine.eval()
    with torch.no_grad():
        mine = [float(engine(val_x[i:i + args["micro"]], val_y[i:i + args["micro"]]))
                for i in range(rank * args["micro"], val_x.shape[0], 2 * args["micro"])]
    total = torch.tensor([sum(mine), len(mine)], dtype=torch.float64)
    dist.all_reduce(total)
    layers = []
    for m, (tokens0, kept0) in zip(getattr(model, "moe_mlps", []), half or []):
        load = m.moe.deepspeed_moe.load
        counts = torch.stack([load.tokens.double(), load.kept.double(), tokens0.double(), kept0.double()])
        dist.all_reduce(counts)
        layers.append(counts.tolist())
    engine.destroy()
    return {"ms": statistics.median(times[args["warmup"]:]) * 1e3,
            "a2a_mb": (a2a.bytes / timed / 1e6) if a2a else 0.0, "val": float(total[0] / total[1]),
            "layers": layers, "params": sum(p.numel() for p in model.parameters())}


def analytic_a2a_mb(experts: int, args: dict) -> float:
    """Four E x C x M fp32 exchanges per MoE layer and step (see the module docstring)."""
    tokens = args["micro"] * args["seq"]
    cap = max(math.ceil(tokens / experts * 1.0), 4)
    moe_layers = args["layers"] // 2
    return 4 * moe_layers * experts * cap * args["hidden"] * 4 / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="dense,moe4,moe8")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--eval_windows", type=int, default=64)
    a = p.parse_args()
    args = {k: getattr(a, k) for k in ("steps", "warmup", "micro", "seq", "layers", "hidden", "eval_windows")}
    print("| run | params/rank | all-to-all MB/step/rank | analytic MB | dropped %, all steps, per MoE layer "
          "| dropped % per expert, 2nd half | token share per expert, 2nd half | ms/step | val loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.runs.split(","):
        r = run_ranks(_run, 2, name, args, timeout=3600)[0]
        experts = int(name[3:]) if name.startswith("moe") else 0
        analytic = analytic_a2a_mb(experts, args) if experts else 0.0
        dropped = "; ".join(f"{100 * (sum(t) - sum(k)) / sum(t):.1f}" for t, k, _, _ in r["layers"]) or "-"
        # second half: per expert, the percentage of its token choices dropped, and its share of the tokens
        per_expert = "; ".join("/".join(f"{100 * ((t - t0) - (k - k0)) / max(t - t0, 1):.0f}"
                                        for t, k, t0, k0 in zip(*layer)) for layer in r["layers"]) or "-"
        share = "; ".join("/".join(f"{(t - t0) / (sum(layer[0]) - sum(layer[2])):.2f}"
                                   for t, t0 in zip(layer[0], layer[2])) for layer in r["layers"]) or "-"
        print(f"| {name} | {r['params'] / 1e6:.3f}M | {r['a2a_mb']:.3f} | {analytic:.3f} | {dropped} | {per_expert} "
              f"| {share} | {r['ms']:.0f} | {r['val']:.4f} |", flush=True)


if __name__ == "__main__":
    main()

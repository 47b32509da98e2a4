"""The byte GPT of examples/train_gpt.py with and without the sequence-length
curriculum: validation loss against tokens trained on and against wall time.

    python bench/curriculum/seqlen_curriculum.py --steps 600 --out bench/curriculum/results.json

Both runs start from the same weights, draw the same windows (the curriculum
run trains on their first curriculum_seqlen bytes) and use the same config
(examples/configs/gpt_demo.json's AdamW and WarmupCosineLR, with the
schedule's steps set to --steps); the curriculum run adds the
`curriculum_learning` section that train_gpt.py --curriculum_seqlen adds
(fixed_linear from --min_seqlen to --seq_len in multiples of 8 over the
first half of the steps, LR schedule counted in tokens). The plain run
takes --steps steps; the curriculum run takes steps until it has trained on
as many tokens (more, shorter steps), so both end their LR schedule. The two engines live
in one process and take their steps alternately, so load from other
processes on the machine falls on both alike; each step is timed on its own
(evaluation excluded). Every --eval_every steps both are scored on the same
held-out windows of --seq_len bytes.

Writes a JSON of both curves and prints a markdown table: at each
evaluation, tokens, seconds and validation loss of each run; then the tokens
and seconds each run needed to reach the plain run's final loss.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import dsrun  # noqa: E402
from byte_data import WindowSampler, eval_windows, load_corpus  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--eval_windows", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--min_seqlen", type=int, default=16)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=64)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--micro_batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="write both curves here (JSON)")
    return p.parse_args()


def configs(args: argparse.Namespace) -> tuple[dict, dict]:
    """(plain, curriculum) ds_configs."""
    with open(ROOT / "examples" / "configs" / "gpt_demo.json") as f:
        plain = json.load(f)
    plain["train_micro_batch_size_per_gpu"] = args.micro_batch
    plain["steps_per_print"] = 10**9
    plain["scheduler"]["params"]["total_num_steps"] = args.steps
    plain["scheduler"]["params"]["warmup_num_steps"] = max(1, args.steps // 10)
    curriculum = copy.deepcopy(plain)
    curriculum["curriculum_learning"] = {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": args.min_seqlen,
        "max_difficulty": args.seq_len, "schedule_type": "fixed_linear", "lr_schedule_in_tokens": True,
        "schedule_config": {"total_curriculum_step": max(1, args.steps // 2), "difficulty_step": 8}}
    return plain, curriculum


@torch.no_grad()
def validation_loss(engine, x: torch.Tensor, y: torch.Tensor, micro: int) -> float:
    engine.eval()
    total = sum(engine(x[i:i + micro], y[i:i + micro]).item() * len(x[i:i + micro]) for i in range(0, len(x), micro))
    engine.train()
    return total / len(x)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    corpus = load_corpus(None, args.seq_len)
    val_x, val_y = eval_windows(corpus.val, args.eval_windows, args.seq_len, 0)
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    runs = {}
    for name, config in zip(("plain", "curriculum"), configs(args)):
        torch.manual_seed(args.seed)
        model = GPT(cfg)
        engine, *_ = dsrun.initialize(model=model, model_parameters=model.param_groups(), config=config)
        runs[name] = {"engine": engine, "sampler": WindowSampler(corpus.train, args.seq_len, seed=args.seed),
                      "tokens": 0, "seconds": 0.0, "curve": []}
    micro = args.micro_batch
    for run in runs.values():
        run["curve"].append((0, 0, 0.0, validation_loss(run["engine"], val_x, val_y, micro)))
    budget = args.steps * micro * args.seq_len  # the plain run's tokens
    step = 0
    while any(run["tokens"] < budget for run in runs.values()):
        step += 1
        for run in runs.values():
            if run["tokens"] >= budget:
                continue
            engine = run["engine"]
            x, y = run["sampler"].sample(micro)
            start = time.perf_counter()
            engine.backward(engine(x, y))
            engine.step()
            run["seconds"] += time.perf_counter() - start
            curriculum = engine.curriculum_scheduler_legacy
            run["tokens"] += micro * (curriculum.get_current_difficulty() if curriculum else args.seq_len)
            if step % args.eval_every == 0 or run["tokens"] >= budget:
                run["curve"].append((step, run["tokens"], run["seconds"],
                                     validation_loss(engine, val_x, val_y, micro)))
    report(runs, args)


def reached(curve: list, target: float):
    """(tokens, seconds) of the first evaluation at or below `target`, or None."""
    for _, tokens, seconds, loss in curve:
        if loss <= target:
            return tokens, seconds
    return None


def report(runs: dict, args: argparse.Namespace) -> None:
    plain, curriculum = runs["plain"]["curve"], runs["curriculum"]["curve"]
    print("| run | step | tokens | train s | val loss |")
    print("|---|---:|---:|---:|---:|")
    for name, curve in (("plain", plain), ("curriculum", curriculum)):
        for step, tokens, seconds, loss in curve:
            print(f"| {name} | {step} | {tokens:,} | {seconds:.1f} | {loss:.4f} |")
    target = plain[-1][3]
    for name, curve in (("plain", plain), ("curriculum", curriculum)):
        hit = reached(curve, target)
        where = f"{hit[0]:,} tokens, {hit[1]:.1f} s" if hit else "not reached"
        print(f"{name}: plain's final loss {target:.4f} reached at {where}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "curves": {k: v["curve"] for k, v in runs.items()},
                       "columns": ["step", "tokens", "train_seconds", "val_loss"]}, f, indent=1)


if __name__ == "__main__":
    main()

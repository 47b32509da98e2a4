"""The byte GPT of the demo with and without random-LTD: validation loss against tokens and wall time.

    .venv/bin/python bench/curriculum/random_ltd.py [--steps 300] [--n_layer 6] [--min_kept 32]
        [--ramp 0.7] [--eval_every 50] [--threads 1] [--json out.json]

Two runs of examples/gpt_model.py (n_layer blocks, n_embd 128, 4 heads,
windows of 128 bytes of the standard library's .py files, micro-batch 16,
one process), the demo's optimizer and LR schedule (AdamW lr 3e-3, betas
(0.9, 0.95), weight decay 0.1, clipping 1.0, linear warm-up over 10% of
the steps, cosine decay to 10%), the same seed, initial weights and
training windows:
- base: every block sees every token.
- ltd: random-LTD (Yao et al. 2022) on every block but the first and the
  last, kept tokens ramping from --min_kept to 128 over --ramp of the steps
  in multiples of 16 (fixed_linear, DeepSpeed's formula), then all tokens.

Every --eval_every steps each run scores the same 32 held-out windows in
eval mode (every token, no dropping). The table gives, at each point, the
data tokens seen (the same for both runs), the layer-tokens computed (block
x token passes: what random-LTD saves), the training wall time and the
process CPU time so far (evaluation excluded) and the validation loss.
Each run is a subprocess with --threads torch threads; wall times are only
comparable on a quiet machine, CPU time (at one thread) stays close to the
work done when other processes share the cores; the losses are deterministic.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEQ, MICRO, EMBD, HEADS, EVAL_WINDOWS, PER_STEP = 128, 16, 128, 4, 32, 16


def ds_config(run: str, steps: int, n_layer: int, min_kept: int, ramp: float) -> dict:
    """The demo's config (examples/configs/gpt_demo.json) for `steps`, with random-LTD for run "ltd"."""
    cfg = json.loads((ROOT / "examples" / "configs" / "gpt_demo.json").read_text())
    cfg["steps_per_print"] = 10**9
    cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=max(1, steps // 10))
    if run == "ltd":
        layers = list(range(1, n_layer - 1))
        cfg["data_efficiency"] = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": n_layer, "random_ltd_layer_num": len(layers),
            "random_ltd_layer_id": layers, "model_mask_name": None, "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": min_kept, "max_value": SEQ, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": max(1, int(ramp * steps)),
                                                        "seq_per_step": PER_STEP}}}}}
    return cfg


def one_run(args: argparse.Namespace) -> dict:
    """Train run `args.one` in this process; the points of its curve."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import dsrun
    from byte_data import WindowSampler, eval_windows, load_corpus
    from dsrun.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd
    from gpt_model import GPT, Block, GPTConfig

    torch.set_num_threads(args.threads)
    corpus = load_corpus(None, SEQ)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(seq_len=SEQ, n_layer=args.n_layer, n_head=HEADS, n_embd=EMBD))
    if args.one == "ltd":
        convert_to_random_ltd(model, Block)
    cfg = ds_config(args.one, args.steps, args.n_layer, args.min_kept, args.ramp)
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.param_groups(), config=cfg)
    sampler = WindowSampler(corpus.train, SEQ, seed=args.seed * 100_003)
    val_x, val_y = eval_windows(corpus.val, EVAL_WINDOWS, SEQ, 0)

    def validation() -> float:
        engine.eval()
        with torch.no_grad():
            loss = sum(engine(val_x[i:i + MICRO], val_y[i:i + MICRO]).item() for i in range(0, EVAL_WINDOWS, MICRO))
        engine.train()
        return loss / (EVAL_WINDOWS // MICRO)

    points = [{"step": 0, "tokens": 0, "layer_tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0, "val": validation()}]
    seconds = cpu_seconds = layer_tokens = 0
    for step in range(1, args.steps + 1):
        kept = SEQ if engine.random_ltd_scheduler is None else min(engine.random_ltd_scheduler.get_current_seq(), SEQ)
        dropping = 0 if args.one == "base" else args.n_layer - 2
        layer_tokens += MICRO * (kept * dropping + SEQ * (args.n_layer - dropping))
        start, start_cpu = time.perf_counter(), time.process_time()
        x, y = sampler.sample(MICRO)
        engine.backward(engine(x, y))
        engine.step()
        seconds += time.perf_counter() - start
        cpu_seconds += time.process_time() - start_cpu
        if step % args.eval_every == 0 or step == args.steps:
            points.append({"step": step, "tokens": step * MICRO * SEQ, "layer_tokens": layer_tokens,
                           "seconds": seconds, "cpu_seconds": cpu_seconds, "val": validation()})
    return {"run": args.one, "points": points}


def table(results: dict[str, dict]) -> str:
    """Markdown: one row per evaluation point, base and ltd side by side."""
    rows = ["| step | data tokens | layer-tokens base | layer-tokens ltd | ltd/base | time base (s) | time ltd (s) "
            "| CPU base (s) | CPU ltd (s) | val base | val ltd | ltd - base |", "|---|" + "---|" * 11]
    for b, d in zip(results["base"]["points"], results["ltd"]["points"]):
        ratio = f"{d['layer_tokens'] / b['layer_tokens']:.2f}" if b["layer_tokens"] else "-"
        rows.append(f"| {b['step']} | {b['tokens']:,} | {b['layer_tokens']:,} | {d['layer_tokens']:,} | {ratio} | "
                    f"{b['seconds']:.1f} | {d['seconds']:.1f} | {b['cpu_seconds']:.1f} | {d['cpu_seconds']:.1f} | "
                    f"{b['val']:.4f} | {d['val']:.4f} | "
                    f"{d['val'] - b['val']:+.4f} |")
    return "\n".join(rows)


def same_loss_cost(results: dict[str, dict]) -> str:
    """When ltd reaches base's final validation loss, if it does: its tokens and time against base's."""
    final = results["base"]["points"][-1]
    for p in results["ltd"]["points"]:
        if p["step"] and p["val"] <= final["val"]:
            return (f"ltd reaches base's final validation loss {final['val']:.4f} at step {p['step']}: "
                    f"{p['tokens'] / final['tokens']:.2f}x the data tokens, "
                    f"{p['layer_tokens'] / final['layer_tokens']:.2f}x "
                    f"the layer-tokens, {p['seconds'] / final['seconds']:.2f}x the wall time, "
                    f"{p['cpu_seconds'] / final['cpu_seconds']:.2f}x the CPU time")
    last = results["ltd"]["points"][-1]
    return (f"ltd ends at {last['val']:.4f}, above base's final {final['val']:.4f}, after "
            f"{last['layer_tokens'] / final['layer_tokens']:.2f}x the layer-tokens and "
            f"{last['seconds'] / final['seconds']:.2f}x the wall time and "
            f"{last['cpu_seconds'] / final['cpu_seconds']:.2f}x the CPU time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--n_layer", type=int, default=6)
    ap.add_argument("--min_kept", type=int, default=32, help="tokens kept at step 0 (of 128)")
    ap.add_argument("--ramp", type=float, default=0.7, help="fraction of the steps the kept count ramps over")
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write both runs' points here")
    ap.add_argument("--one", choices=("base", "ltd"), help=argparse.SUPPRESS)  # a single run, in a subprocess
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.n_layer < 3:
        ap.error("--n_layer must be at least 3: the first and last blocks keep every token")
    if args.one:
        args.out.write_text(json.dumps(one_run(args)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for run in ("base", "ltd"):
            out = Path(work) / f"{run}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", run, "--out", str(out)]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr)[-4000:]
                raise SystemExit(f"{run} failed ({proc.returncode}); its output ends:\n{tail}")
            results[run] = json.loads(out.read_text())
    print(f"byte GPT, {args.n_layer} blocks x {EMBD} wide, windows of {SEQ}, micro-batch {MICRO}, {args.steps} steps, "
          f"{args.threads} thread(s); ltd: blocks 1-{args.n_layer - 2} keep {args.min_kept} -> {SEQ} tokens over "
          f"{int(args.ramp * args.steps)} steps")
    print(table(results))
    print(same_loss_cost(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

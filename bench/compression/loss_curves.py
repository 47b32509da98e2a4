"""Loss curves of the GPT demo under each 1-bit optimizer and its uncompressed counterpart.

    .venv/bin/python bench/compression/loss_curves.py [--steps 400] [--freeze 100]
        [--runs adam,onebitadam,zerooneadam,lamb,onebitlamb] [--png bench/compression/loss_curves.png]

Each configuration trains examples/train_gpt.py (0.84M-parameter byte-level
GPT, `make demo`) for --steps steps on 2 local ranks with the demo's
config (examples/configs/gpt_demo.json: lr 3e-3, betas (0.9, 0.95),
weight decay 0.1, gradient clipping 1.0, linear LR warm-up over the first
10% of the steps then cosine decay to 10%), the same seed and data; only the
optimizer differs:
- adam: "AdamW" (the demo's).
- onebitadam: "OneBitAdam", freeze_step --freeze.
- zerooneadam: "ZeroOneAdam", var_freeze_step --freeze, var_update_scaler 16
  (DeepSpeed's), local_step_scaler --freeze, local_step_clipper 16: the
  variance is updated on steps 1, 2, ... 16, then every 2nd, 4th ... step up
  to --freeze; after it the interval between synchronisations doubles every
  --freeze steps (1, 2, 4 ...).
- zerooneadam-nolocal (not run by default): the same with DeepSpeed's
  default local_step_scaler 32678, so no local steps within a short run:
  separates the effect of the frozen variance from that of skipped rounds.
- lamb: "Lamb" (DeepSpeed's FusedLamb), max_coeff 0.3, min_coeff 0.01.
- onebitlamb: "OneBitLamb", freeze_step --freeze, with DeepSpeed's tutorial
  values max_coeff 0.3, min_coeff 0.01, coeff_beta 0.9, factor_max 4.0,
  factor_min 0.5, factor_threshold 0.1.
Warm-up: DeepSpeed's tutorials freeze after roughly a sixth to a fifth of
training (1-bit Adam: freeze_step 23000 for BERT pre-training, 400 for SQuAD
fine-tuning), always after the LR warm-up; --freeze 100 of 400 steps is a
quarter, 2.5x the demo's 40-step LR warm-up.

Prints a markdown table (training loss averaged over 25-step windows, the
validation loss before and after, each as the difference to adam's) and
writes the PNG (matplotlib, the `test`/`plot` extra): per-step training loss
of rank 0, smoothed over 10 steps, one line per configuration, the freeze
step marked. Configurations run one after another (the losses do not depend
on the machine's load; the run is deterministic).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = ("adam", "onebitadam", "zerooneadam", "lamb", "onebitlamb", "zerooneadam-nolocal")
DEFAULT_RUNS = RUNS[:5]
LAMB_COEFFS = {"max_coeff": 0.3, "min_coeff": 0.01}
WINDOW = 25


def config(run: str, steps: int, freeze: int) -> dict:
    """The demo's config with configuration `run`'s optimizer and `steps` scheduler steps."""
    cfg = json.loads((ROOT / "examples" / "configs" / "gpt_demo.json").read_text())
    params = copy.deepcopy(cfg["optimizer"]["params"])
    extra = {
        "adam": ("AdamW", {}),
        "onebitadam": ("OneBitAdam", {"freeze_step": freeze}),
        "zerooneadam": ("ZeroOneAdam", {"var_freeze_step": freeze, "var_update_scaler": 16,
                                        "local_step_scaler": freeze, "local_step_clipper": 16}),
        "zerooneadam-nolocal": ("ZeroOneAdam", {"var_freeze_step": freeze, "var_update_scaler": 16,
                                                "local_step_scaler": 32678, "local_step_clipper": 16}),
        "lamb": ("Lamb", LAMB_COEFFS),
        "onebitlamb": ("OneBitLamb", {"freeze_step": freeze, **LAMB_COEFFS, "coeff_beta": 0.9, "factor_max": 4.0,
                                      "factor_min": 0.5, "factor_threshold": 0.1}),
    }[run]
    cfg["optimizer"] = {"type": extra[0], "params": {**params, **extra[1]}}
    cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=steps // 10)
    return cfg


def train(run: str, steps: int, freeze: int, work: Path) -> dict:
    """Run the demo with `run`'s optimizer; rank 0's per-step losses and the validation losses."""
    cfg = work / f"{run}.json"
    cfg.write_text(json.dumps(config(run, steps, freeze)))
    cmd = [sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", "2", "examples/train_gpt.py",
           "--config", str(cfg), "--steps", str(steps), "--log_every", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    out = proc.stdout + proc.stderr
    (work / f"{run}.log").write_text(out)
    if proc.returncode != 0:
        raise SystemExit(f"{run}: dsrun exited with {proc.returncode}; its output ends:\n{out[-4000:]}")
    losses = [float(v) for v in re.findall(r"^\[rank 0\] step \d+/\d+\s+loss (\S+)", out, re.M)]
    val = re.search(r"^\[rank 0\] validation loss: before (\S+)\s+after (\S+)", out, re.M)
    if len(losses) != steps or val is None:
        raise SystemExit(f"{run}: expected {steps} loss lines and a validation line; the output ends:\n{out[-4000:]}")
    return {"losses": losses, "val_before": float(val.group(1)), "val_after": float(val.group(2))}


def table(results: dict[str, dict], steps: int) -> str:
    """Markdown: mean training loss per WINDOW-step window, and the validation loss after training."""
    edges = list(range(0, steps, WINDOW))
    head = " | ".join(f"{a + 1}-{min(a + WINDOW, steps)}" for a in edges)
    rows = [f"| optimizer | {head} | validation after | vs adam |",
            "|---|" + "---|" * (len(edges) + 2)]
    base = results.get("adam", {}).get("val_after")
    for run, r in results.items():
        cells = " | ".join(f"{statistics.fmean(r['losses'][a:a + WINDOW]):.3f}" for a in edges)
        diff = f"{r['val_after'] - base:+.3f}" if base is not None else "-"
        rows.append(f"| {run} | {cells} | {r['val_after']:.4f} | {diff} |")
    return "\n".join(rows)


def plot(results: dict[str, dict], freeze: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for run, r in results.items():
        xs = r["losses"]
        smooth = [statistics.fmean(xs[max(0, i - 9):i + 1]) for i in range(len(xs))]
        ax.plot(range(1, len(xs) + 1), smooth, label=f"{run} (validation after {r['val_after']:.3f})", lw=1.3)
    ax.axvline(freeze, color="grey", ls="--", lw=0.8)
    ax.text(freeze, ax.get_ylim()[1], " freeze", va="top", color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss, nats/byte (rank 0, mean of 10 steps)")
    ax.set_title("GPT demo (0.84M parameters), 2 ranks: compressed vs plain optimizers")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--freeze", type=int, default=100, help="freeze_step / var_freeze_step")
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS))
    ap.add_argument("--png", type=Path, default=ROOT / "bench" / "compression" / "loss_curves.png")
    args = ap.parse_args()
    runs = args.runs.split(",")
    for run in runs:
        if run not in RUNS:
            raise SystemExit(f"unknown configuration {run!r}; known: {', '.join(RUNS)}")
    if not 0 < args.freeze < args.steps:
        raise SystemExit(f"--freeze {args.freeze} must be between 0 and --steps {args.steps}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="dsrun-loss-curves-") as tmp:
        for run in runs:
            results[run] = train(run, args.steps, args.freeze, Path(tmp))
            r = results[run]
            print(f"{run}: validation {r['val_before']:.4f} -> {r['val_after']:.4f}, last {WINDOW} steps "
                  f"{statistics.fmean(r['losses'][-WINDOW:]):.4f}", file=sys.stderr, flush=True)
    print(table(results, args.steps))
    plot(results, args.freeze, args.png)
    print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()

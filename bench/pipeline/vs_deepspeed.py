"""dsrun's pipeline step beside DeepSpeed's on one client (mlp_client.py).

    .venv/bin/python bench/pipeline/vs_deepspeed.py --deepspeed-venv /work/dsvenv \\
        --cases p2d2-w256-m8,p4-w256-m8 --repeats 3 [--action-timing]

A case is `p<stages>[d<data>]-w<width>-m<micro-batches>` on 4 ranks (d =
4 / stages when omitted). For every repeat and case the client is launched
once per library, alternating which goes first (DeepSpeed, dsrun; then
dsrun, DeepSpeed; ...), each a fresh torchrun of 4 processes. A launch
gives --steps timed steps after --warmup; a step's time is the slowest
rank's `train_batch`; its CPU time is summed over the ranks (every thread:
a rank that spins while it waits shows here). Per case and library: min / median / spread over all
timed steps of all launches; dsrun / DeepSpeed is the ratio of the medians,
and per repeat the ratio of that repeat's two launch medians (min-max).
Without a DeepSpeed venv (--deepspeed-venv or DSRUN_BENCH_DEEPSPEED) only
the dsrun column appears.

--action-timing adds, for dsrun's launches, the executor's per-action table
([Note: per-action timing] in dsrun/runtime/parallel/pipe/timing.py): per
stage and action kind, the mean count per step and milliseconds per action
(total, waiting on a neighbour, in the model / autograd, and the rest: the
executor's own cost; and the executor thread's CPU time), medians over the
timed steps of the last repeat.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspeed_column import deepspeed_venv, load_average, run_interleaved, split_variant, table  # noqa: E402

CLIENT = Path(__file__).resolve().parent / "mlp_client.py"
CASE = re.compile(r"p(\d+)(?:d(\d+))?-w(\d+)-m(\d+)")
WORLD = 4


def _client_args(case: str, args) -> list[str]:
    found = CASE.fullmatch(case)
    if not found:
        raise SystemExit(f"--cases: {case!r} is not p<stages>[d<data>]-w<width>-m<micro-batches>, e.g. p2d2-w256-m8")
    stages, data, width, micro_batches = (int(g) if g else None for g in found.groups())
    if stages * (data or WORLD // stages) != WORLD:
        raise SystemExit(f"--cases: {case!r} needs stages x data = {WORLD}")
    return ["--stages", str(stages), "--width", str(width), "--micro-batches", str(micro_batches),
            "--blocks", str(args.blocks), "--micro", str(args.micro), "--seq", str(args.seq),
            "--warmup", str(args.warmup), "--steps", str(args.steps)]


def _action_table(case: str, result: dict) -> list[str]:
    rows = [f"\nPer-action time, {case} (per step: count; ms per action: total / wait / compute / "
            "rest = total - wait - compute / CPU of the executor's thread)\n", "| rank (stage) | action | count | "
            "total ms | wait ms | compute ms | rest ms | rest ms per step | CPU ms | CPU ms per step |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for rank in result["actions"]:
        kinds = sorted({k for t in rank["tables"] for k in t})
        for kind in kinds:
            per = [t[kind] for t in rank["tables"] if kind in t]
            count = statistics.median(r["count"] for r in per)
            med = {f: statistics.median(r.get(f, float("nan")) / r["count"] for r in per) * 1e3
                   for f in ("total_s", "wait_s", "compute_s", "cpu_s")}
            rest = med["total_s"] - med["wait_s"] - med["compute_s"]
            rows.append(f"| {rank['rank']} ({rank['stage']}) | {kind} | {count:g} | {med['total_s']:.2f} | "
                        f"{med['wait_s']:.2f} | {med['compute_s']:.2f} | {rest:.2f} | {rest * count:.1f} | "
                        f"{med['cpu_s']:.2f} | {med['cpu_s'] * count:.1f} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="p2d2-w256-m8,p4-w256-m8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--seq", type=int, default=0)
    p.add_argument("--deepspeed-venv", default=None)
    p.add_argument("--action-timing", action="store_true")
    p.add_argument("--also", default="", help="more dsrun runs, e.g. dsrun:DSRUN_SHM_COMM=0 (comma-separated)")
    args = p.parse_args()
    venv = deepspeed_venv(args.deepspeed_venv)
    variants = (["deepspeed", "dsrun"] if venv else ["dsrun"]) + [v for v in args.also.split(",") if v]
    for variant in variants:
        split_variant(variant)
    cases = {case: _client_args(case, args) for case in args.cases.split(",")}
    print(load_average(), flush=True)
    results = run_interleaved(cases, variants, venv, CLIENT, WORLD, args.repeats,
                              lambda v: ["--action-timing"] if args.action_timing and v.startswith("dsrun") else [])
    print(load_average())
    print(f"\n{WORLD} ranks x 1 thread, gloo, fp32, ZeRO 0, SGD; {args.blocks} residual MLP blocks, micro-batch "
          f"{args.micro} x {f'{args.seq} x ' if args.seq else ''}width; {args.repeats} interleaved repeats x "
          f"{args.steps} timed steps after {args.warmup} warm-up"
          + ("" if venv else "; no DeepSpeed venv named: dsrun only") + "\n")
    print(table(results, cases, variants))
    if args.action_timing:
        for case in cases:
            for v in variants:
                if results["last"][(case, v)]["actions"] is not None:  # a dsrun with action_timing
                    print("\n".join(_action_table(f"{case}, {v}", results["last"][(case, v)])))


if __name__ == "__main__":
    main()

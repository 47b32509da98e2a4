"""dsrun's MoE training step beside DeepSpeed's on one client (moe_client.py).

    .venv/bin/python bench/moe/vs_deepspeed.py --deepspeed-venv /work/dsvenv \\
        --cases ep1-z0,ep2-z0,ep4-z0,ep1-z2,ep2-z2,ep4-z2 --repeats 3

A case is `ep<P>-z<stage>` on 4 ranks: 4 experts of 256 -> 1024 -> 256,
top-1, 512 tokens per rank, expert-parallel degree P, ZeRO stage. For every
repeat and case the client is launched once per library, alternating which
goes first, each a fresh torchrun of 4 processes; --steps timed steps after
--warmup. Per case and library: min / median / spread over all timed steps
of all launches, median CPU ms per step summed over the ranks; dsrun /
DeepSpeed is the ratio of the medians, and per repeat the ratio of that
repeat's two launch medians (min-max). Without a DeepSpeed venv
(--deepspeed-venv or DSRUN_BENCH_DEEPSPEED) only dsrun runs. --also adds
runs (dsrun:NAME=VALUE for an environment setting, dsrun@CHECKOUT for
another checkout with its own .venv: bench/deepspeed_column.py). A second
table gives each rank's CPU milliseconds per step (process time; median
over the timed steps of all launches) and the ratio of the mean per rank.

--profile DIR instead launches each case once per run with every rank
profiled and prints profile_table.py's table per case (the files stay in
DIR/<run>).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspeed_column import (deepspeed_venv, launch, load_average, run_interleaved, split_variant,  # noqa: E402
                               table)
import profile_table  # noqa: E402 - this directory (sys.path[0])

CLIENT = Path(__file__).resolve().parent / "moe_client.py"
CASE = re.compile(r"ep(\d+)-z(\d)")
WORLD = 4


def _client_args(case: str, args) -> list[str]:
    found = CASE.fullmatch(case)
    if not found or WORLD % int(found.group(1)):
        raise SystemExit(f"--cases: {case!r} is not ep<P>-z<stage> with P dividing {WORLD}, e.g. ep2-z0")
    return ["--ep", found.group(1), "--zero", found.group(2), "--tokens", str(args.tokens),
            "--warmup", str(args.warmup), "--steps", str(args.steps)]


def cpu_table(results: dict, cases, variants: list[str]) -> str:
    """Markdown: per case and run, each rank's median CPU ms per step over
    every launch's timed steps, and the mean per rank over DeepSpeed's."""
    lines = ["| case | " + " | ".join(f"{v}: CPU ms/step, rank 0-{WORLD - 1}" for v in variants)
             + (" | CPU per rank / DeepSpeed's |" if "deepspeed" in variants else " |")]
    lines.append("|---" * (lines[0].count("|") - 1) + "|")
    for case in cases:
        means, cells = {}, []
        for v in variants:
            per_rank = [statistics.median(s for r in results["results"][(case, v)] for s in r["cpu_rank_s"][rank])
                        for rank in range(WORLD)]
            means[v] = statistics.mean(per_rank)
            cells.append(" / ".join(f"{c * 1e3:.0f}" for c in per_rank))
        if "deepspeed" in variants:
            cells.append(", ".join(f"{v} {means[v] / means['deepspeed']:.2f}" for v in variants if v != "deepspeed"))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile(cases: dict[str, list[str]], variants: list[str], venv, directory: Path) -> None:
    """Launch every case once per run with --profile (into DIR/<run>) and print the tables."""
    for case, args in cases.items():
        by_run = {}
        for variant in variants:
            where = directory / re.sub(r"[^A-Za-z0-9_.=-]+", "_", variant)
            where.mkdir(parents=True, exist_ok=True)
            launch(variant, venv, CLIENT, WORLD, args + ["--profile", str(where.resolve())])
            by_run[variant] = profile_table.load(where, case)
        print(f"\n### {case}: every rank's profile, per step\n\n{profile_table.table(by_run)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="ep1-z0,ep2-z0,ep4-z0,ep1-z2,ep2-z2,ep4-z2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--deepspeed-venv", default=None)
    p.add_argument("--also", default="", help="more runs, comma-separated (see the module docstring)")
    p.add_argument("--profile", metavar="DIR", default=None, help="profile every rank instead of timing")
    args = p.parse_args()
    venv = deepspeed_venv(args.deepspeed_venv)
    variants = (["deepspeed", "dsrun"] if venv else ["dsrun"]) + [v for v in args.also.split(",") if v]
    for variant in variants:
        split_variant(variant)
    cases = {case: _client_args(case, args) for case in args.cases.split(",")}
    print(load_average(), flush=True)
    if args.profile:
        profile(cases, variants, venv, Path(args.profile))
        return
    results = run_interleaved(cases, variants, venv, CLIENT, WORLD, args.repeats)
    print(load_average())
    print(f"\n{WORLD} ranks x 1 thread, gloo, fp32, SGD; 4 experts 256 -> 1024 -> 256, top-1, {args.tokens} tokens "
          f"per rank; {args.repeats} interleaved repeats x {args.steps} timed steps after {args.warmup} warm-up"
          + ("" if venv else "; no DeepSpeed venv named: dsrun only") + "\n")
    print(table(results, cases, variants))
    print()
    print(cpu_table(results, cases, variants))


if __name__ == "__main__":
    main()

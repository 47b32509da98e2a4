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
another checkout with its own .venv: bench/deepspeed_column.py).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspeed_column import deepspeed_venv, load_average, run_interleaved, split_variant, table  # noqa: E402

CLIENT = Path(__file__).resolve().parent / "moe_client.py"
CASE = re.compile(r"ep(\d+)-z(\d)")
WORLD = 4


def _client_args(case: str, args) -> list[str]:
    found = CASE.fullmatch(case)
    if not found or WORLD % int(found.group(1)):
        raise SystemExit(f"--cases: {case!r} is not ep<P>-z<stage> with P dividing {WORLD}, e.g. ep2-z0")
    return ["--ep", found.group(1), "--zero", found.group(2), "--tokens", str(args.tokens),
            "--warmup", str(args.warmup), "--steps", str(args.steps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="ep1-z0,ep2-z0,ep4-z0,ep1-z2,ep2-z2,ep4-z2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--deepspeed-venv", default=None)
    p.add_argument("--also", default="", help="more runs, comma-separated (see the module docstring)")
    args = p.parse_args()
    venv = deepspeed_venv(args.deepspeed_venv)
    variants = (["deepspeed", "dsrun"] if venv else ["dsrun"]) + [v for v in args.also.split(",") if v]
    for variant in variants:
        split_variant(variant)
    cases = {case: _client_args(case, args) for case in args.cases.split(",")}
    print(load_average(), flush=True)
    results = run_interleaved(cases, variants, venv, CLIENT, WORLD, args.repeats)
    print(load_average())
    print(f"\n{WORLD} ranks x 1 thread, gloo, fp32, SGD; 4 experts 256 -> 1024 -> 256, top-1, {args.tokens} tokens "
          f"per rank; {args.repeats} interleaved repeats x {args.steps} timed steps after {args.warmup} warm-up"
          + ("" if venv else "; no DeepSpeed venv named: dsrun only") + "\n")
    print(table(results, cases, variants))


if __name__ == "__main__":
    main()

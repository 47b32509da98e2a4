"""Peak resident memory per rank of pipe 2 x data 2 under ZeRO-3 beside
ZeRO-1, same GPT, same global batch.

    .venv/bin/python bench/pipeline/zero3_memory.py [--model bench|bench-v256|48m] [--repeats 2] [--steps 2]

Model and data: bench/pipeline/pipeline_bubble.py's GPT as a PipelineModule
(embedding, blocks, head; partitioned "type:Block"), fp32, AdamW from
ds_config (dsrun's CPU Adam), 1F1B, 4 ranks (2 stages x 2 data-parallel
replicas) x 1 torch thread, `--global_micro_batches` micro-batches per step.
ZeRO-1 partitions the Adam moments over each stage's 2 data ranks; ZeRO-3
also the fp32 parameters and gradients, gathering one layer at a time
("3": DeepSpeed's default prefetch and reuse knobs; "3-lean": no prefetch,
nothing kept gathered for reuse; see CONFIGS).

Per rank and launch: `base` = VmRSS after the model is built, before
`dsrun.initialize` (the interpreter, torch and the full stage); `first` =
VmHWM (peak resident set, /proc/self/status) over initialize and the
first step; `peak` = VmHWM over the `--steps` steps after it (reset by
writing 5 to /proc/self/clear_refs); `steady` = VmRSS at the end; `model states` = the bytes the strategy holds
(strategy.memory_breakdown(), every category summed: parameters,
gathered ones, gradients, Adam moments, reduction buffers). Launches alternate
1, 3, 3-lean, 1, ... (`--repeats` each), each a fresh set of 4
processes; the table gives per stage the median over data ranks and
repeats, min-max beside it, and peak over ZeRO-1's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.pipeline.pipeline_bubble import MODELS as BUBBLE_MODELS  # noqa: E402
from bench.pipeline.pipeline_bubble import _micro_batch, layer_specs, lm_loss  # noqa: E402
from bench.step_time.gpt_step import LR, WEIGHT_DECAY, Shape  # noqa: E402
from tests.dist_helpers import run_ranks  # noqa: E402

WORLD, STAGES = 4, 2
# "48m-v2k": the 48M GPT's blocks with a 2048-word vocabulary and 128 tokens: no layer is more than a
# tenth of a stage (the 48M's 32000 x 512 embedding and head are half of theirs).
MODELS = {**BUBBLE_MODELS, "48m-v2k": Shape(d=512, layers=10, heads=8, vocab=2048, seq=128, micro=2,
                                            bucket=5_000_000)}


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))


# Configurations: ZeRO-1; ZeRO-3 with DeepSpeed's default knobs (a 5e7-element prefetch window and
# reuse distance 1e9: a stage this small stays gathered through the step, see zero/schedule.py
# [Note: the fetch trace]); ZeRO-3 gathering one layer at a time (no prefetch, nothing kept for reuse).
CONFIGS = {"1": {"stage": 1}, "3": {"stage": 3},
           "3-lean": {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}


def _rank(config: str, model: str, global_micro: int, steps: int) -> dict:
    import torch

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed

    init_distributed()
    torch.manual_seed(0)
    s = MODELS[model]
    micro_batches = global_micro // (WORLD // STAGES)
    module = PipelineModule(layer_specs(s), num_stages=STAGES, loss_fn=lm_loss, partition_method="type:Block")
    base = _status_mib("VmRSS")
    params = sum(p.numel() for p in module.parameters())  # before stage 3 partitions them
    cfg = {"train_micro_batch_size_per_gpu": s.micro, "gradient_accumulation_steps": micro_batches,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
           "zero_optimization": CONFIGS[config], "gradient_clipping": 1.0, "steps_per_print": 10**9}
    engine, *_ = dsrun.initialize(model=module, config=cfg)
    data_rank = engine.grid.get_data_parallel_rank()
    first = None
    for i in range(1 + steps):
        engine.train_batch(iter([_micro_batch(s, i, data_rank, j) for j in range(micro_batches)]))
        if i == 0:  # initialize and the first step behind: the training peak from here
            first = _status_mib("VmHWM")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
    held = sum(n for dtypes in engine.strategy.memory_breakdown().values() for n in dtypes.values())
    return {"stage": engine.stage_id, "base": base, "first": first, "peak": _status_mib("VmHWM"),
            "steady": _status_mib("VmRSS"), "states": held / 2**20, "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bench", choices=sorted(MODELS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--global_micro_batches", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for rep in range(args.repeats):
        for config in CONFIGS:  # interleaved: A B C A B C
            results[config] += run_ranks(_rank, WORLD, config, args.model, args.global_micro_batches, args.steps,
                                         timeout=args.timeout)
            print(f"[repeat {rep + 1}/{args.repeats}] ZeRO {config} done", file=sys.stderr, flush=True)
    s = MODELS[args.model]
    print(f"\nGPT {args.model} (d={s.d}, {s.layers} blocks, vocab {s.vocab}, seq {s.seq}, micro-batch {s.micro}), "
          f"fp32 AdamW, pipe {STAGES} x data {WORLD // STAGES}, 1F1B, {args.global_micro_batches} micro-batches "
          f"per step, {args.steps} steps, {args.repeats} interleaved repeats. MiB per rank: median [min-max] over "
          "data ranks and repeats.\n")
    print("| stage | parameters (M) | ZeRO | base (before initialize) | model states held | first (initialize + "
          "step 1) | peak RSS (later steps) | peak - base | steady RSS | peak / ZeRO-1 peak | (peak - base) / ZeRO-1's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def col(rows, key):
        values = [r[key] for r in rows]
        return statistics.median(values), f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"

    for st in range(STAGES):
        one = [r for r in results["1"] if r["stage"] == st]
        peak1 = statistics.median(r["peak"] for r in one)
        grow1 = statistics.median(r["peak"] - r["base"] for r in one)
        for zero in CONFIGS:
            rows = [r for r in results[zero] if r["stage"] == st]
            for r in rows:
                r["grow"] = r["peak"] - r["base"]
            peak, peak_s = col(rows, "peak")
            grow, grow_s = col(rows, "grow")
            print(f"| {st} | {rows[0]['params'] / 1e6:.2f} | {zero} | {col(rows, 'base')[1]} | {col(rows, 'states')[1]} "
                  f"| {col(rows, 'first')[1]} | {peak_s} | {grow_s} | {col(rows, 'steady')[1]} | {peak / peak1:.3f} | {grow / grow1:.3f} |")


if __name__ == "__main__":
    main()

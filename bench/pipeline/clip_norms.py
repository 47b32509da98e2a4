"""Gradient clipping in a 4-stage pipeline: the global gradient norm dsrun
clips on beside each stage's own norm. DeepSpeed 0.19.8's PipelineEngine
without ZeRO (fp32, `clip_fp32_gradients`) clips every stage on the first
stage's norm; with ZeRO stage 1 it clips on the global norm, as dsrun.

    .venv/bin/python bench/pipeline/clip_norms.py              # gradient_clipping 1.7, 10 steps
    .venv/bin/python bench/pipeline/clip_norms.py --clip 0     # no clipping: the raw norms

With 1.7 the first step whose global norm passes it is step 7 (global 1.93,
stages 1.61 / 0.43 / 0.42 / 0.86 when measured): dsrun clips there, a clip
on the first stage's norm (or on any one stage's) does not, and the runs
part from step 8 on.

4 ranks (gloo, tests/dist_helpers.run_ranks), 4 stages x 1 data-parallel
replica, 1F1B, ZeRO stage 0, fp32, torch's AdamW (lr 1e-2), 4 micro-batches
of 8 samples per step. The model: 8 blocks of Linear(64, 64) + Tanh and a
Linear(64, 10) head, partitioned uniformly (2 or 3 layers a stage), no tied
weights; inputs and class labels are fixed random tensors (seed 0), the
loss cross-entropy.

Per step it prints the global L2 norm of all gradients before clipping
(`engine.get_global_grad_norm()`, what dsrun clips on, as a one-process run
would), each stage's own L2 norm before clipping, whether dsrun clips, and
which stages' own norms exceed `gradient_clipping` (stage 0's decides for
DeepSpeed's ZeRO-0 pipeline). The stage
norms are read in an optimizer step pre-hook, after clipping, and divided
by torch's clip coefficient min(1, clip / (global + 1e-6)); their squares
add up to the global norm's square (printed as a check).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.dist_helpers import run_ranks  # noqa: E402

STAGES, WIDTH, BLOCKS, CLASSES = 4, 64, 8, 10
MICRO, MICRO_BATCHES = 8, 4


def _rank(clip: float, steps: int) -> list[dict]:
    """This rank's (one stage's) norms per step and the batch's mean loss:
    {"global", "stage", "loss"}."""
    import torch
    import torch.nn as nn

    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed

    init_distributed()
    torch.manual_seed(0)
    layers = [spec for _ in range(BLOCKS) for spec in (LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.Tanh))]
    module = PipelineModule(layers + [LayerSpec(nn.Linear, WIDTH, CLASSES)], num_stages=STAGES,
                            loss_fn=nn.CrossEntropyLoss(), partition_method="uniform")
    params = [p for p in module.parameters() if p.requires_grad]
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICRO_BATCHES,
           "zero_optimization": {"stage": 0}, "gradient_clipping": clip, "steps_per_print": 10**9}
    engine, *_ = dsrun.initialize(model=module, optimizer=torch.optim.AdamW(params, lr=1e-2), config=cfg)
    clipped_sq = []
    engine.optimizer.register_step_pre_hook(
        lambda *_: clipped_sq.append(sum(float(p.grad.float().square().sum()) for p in params if p.grad is not None)))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(MICRO, WIDTH, generator=g), torch.randint(0, CLASSES, (MICRO,), generator=g))
            for _ in range(MICRO_BATCHES)]
    out = []
    for _ in range(steps):
        loss = engine.train_batch(iter(data))
        total = engine.get_global_grad_norm()
        coef = min(1.0, clip / (total + 1e-6)) if clip > 0 else 1.0
        out.append({"global": total, "stage": math.sqrt(clipped_sq[-1]) / coef, "loss": float(loss)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", type=float, default=1.7, help="gradient_clipping (0: off)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    ranks = run_ranks(_rank, STAGES, args.clip, args.steps, timeout=args.timeout)
    print(f"4 stages, gradient_clipping {args.clip:g}: L2 norms before clipping")
    print("step    loss  global   " + "  ".join(f"stage {s}" for s in range(STAGES))
          + "   sqrt(sum sq)  dsrun clips  stages over the clip")
    for step in range(args.steps):
        total = ranks[0][step]["global"]
        stage = [ranks[s][step]["stage"] for s in range(STAGES)]
        own = [s for s in range(STAGES) if stage[s] > args.clip > 0]
        print(f"{step + 1:>4}  {ranks[STAGES - 1][step]['loss']:6.4f}  {total:7.4f}  " + "  ".join(f"{n:7.4f}" for n in stage)
              + f"   {math.sqrt(sum(n * n for n in stage)):12.4f}  {'yes' if total > args.clip > 0 else 'no':>11}"
              + f"  {','.join(map(str, own)) or 'none':>20}")


if __name__ == "__main__":
    main()

"""Memory and all-gather bytes of ZeRO stage 3 with frozen parameters, with
and without ZeRO++ zero_quantized_nontrainable_weights, on 4 ranks as 2 nodes x 2.

    .venv/bin/python bench/compression/qnw_bytes.py [--model small|48m] [--steps 3] [--precisions fp32,bf16]

Model: the GPT of bench/step_time/gpt_step.py (`small`: 5.2M parameters,
`48m`: 48.0M) with its embeddings (wte, tied to the head, and wpe) and the
first half of its blocks frozen, as when fine-tuning the top of a
pretrained model; ZeRO stage 3, dsrun's AdamW (lr 1e-4), the same data on
every run. LOCAL_RANK = rank mod 2 and LOCAL_WORLD_SIZE = 2 make the 4
local ranks 2 nodes of 2 (dsrun/runtime/distributed/nodes.py).

Per precision, "plain" and "qnw" each run one uncounted step, then --steps
counted ones. Reported per rank: the parameter bytes `memory_breakdown()`
shows per dtype (the frozen shards are the int8 part with qnw), and per
step, from the comms logger, the bus bytes of every collective and their
inter-node part. The gradient reduction, the trainable parameters'
gathers, the loss and the norm are the same in both runs, so the
difference is what the frozen parameters' all-gathers save; "int8 out"
is the output of those gathers with qnw (every rank's int8 message, as the
logger counts an all_gather_into_tensor), per step.
No timings: the figures are counts and do not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step_time"))

import torch  # noqa: E402

from counted import counted_steps  # noqa: E402
from gpt_step import GPT, MODELS  # noqa: E402  (the same model as the step-time benchmark)
from tests.dist_helpers import as_nodes, run_ranks  # noqa: E402

WORLD, PER_NODE = 4, 2


def _frozen(name: str, layers: int) -> bool:
    return name.startswith(("wte.", "wpe.")) or any(name.startswith(f"h.{i}.") for i in range(layers // 2))


def _rank(model_name: str, precision: str, qnw: bool, steps: int) -> dict:
    as_nodes(PER_NODE)
    import dsrun
    from dsrun.runtime import comm

    s = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(s)
    for n, p in model.named_parameters():
        p.requires_grad_(not _frozen(n, s.layers))
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    cfg = {"train_micro_batch_size_per_gpu": s.micro, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": s.bucket,
                                 "zero_quantized_nontrainable_weights": qnw}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = dsrun.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=cfg)
    losses, stats = counted_steps(engine, s, comm.get_rank(), 1, steps)
    int8 = stats.get("all_gather_into_tensor")
    return {"losses": losses, "frozen": frozen, "params": engine.memory_breakdown()["params"],
            "bus": sum(st.bus_bytes for st in stats.values()) / steps,
            "inter": sum(st.inter_node_bus_bytes for st in stats.values()) / steps,
            "int8_sent": (int8.bytes / steps) if qnw and int8 is not None else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precisions", default="fp32,bf16")
    args = parser.parse_args()
    mib = 2 ** 20
    print(f"model {args.model}, stage 3, embeddings and the first half of the blocks frozen, "
          f"{WORLD} ranks as {WORLD // PER_NODE} nodes x {PER_NODE}, {args.steps} counted steps; MiB per rank")
    for precision in args.precisions.split(","):
        res = {name: run_ranks(_rank, WORLD, args.model, precision, q, args.steps, timeout=3600)[0]
               for name, q in (("plain", False), ("qnw", True))}
        print(f"\n{precision}: {res['plain']['frozen'] / 1e6:.2f}M frozen parameters")
        print(f"{'run':<6} {'params (memory_breakdown)':<36} {'bus/step':>9} {'inter-node':>11} {'int8 out':>10}")
        for name, r in res.items():
            params = ", ".join(f"{k} {v / mib:.3f}" for k, v in sorted(r["params"].items()))
            print(f"{name:<6} {params:<36} {r['bus'] / mib:9.3f} {r['inter'] / mib:11.3f} "
                  f"{r['int8_sent'] / mib:10.3f}")
        plain, qnw = res["plain"], res["qnw"]
        print(f"parameter bytes plain/qnw {sum(plain['params'].values()) / sum(qnw['params'].values()):.2f}x; "
              f"bus bytes per step plain/qnw {plain['bus'] / qnw['bus']:.2f}x, "
              f"inter-node {plain['inter'] / qnw['inter']:.2f}x")
        for name in ("plain", "qnw"):
            print(f"losses {name:<5}", " ".join(f"{x:.4f}" for x in res[name]["losses"]))


if __name__ == "__main__":
    main()

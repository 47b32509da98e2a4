"""Gradient bytes per step of ZeRO stage 3 with and without ZeRO++ qgZ, on 4 ranks as 2 nodes x 2.

    .venv/bin/python bench/compression/qgz_bytes.py [--model small|48m] [--steps 3] [--precisions fp32,bf16]

Model: the GPT of bench/step_time/gpt_step.py (`small`: 5.2M parameters,
`48m`: 48.0M), ZeRO stage 3, dsrun's AdamW (lr 1e-4), the same data on
every run. The 4 ranks run on this machine; LOCAL_RANK = rank mod 2 and
LOCAL_WORLD_SIZE = 2 make them 2 nodes of 2 ranks (dsrun/runtime/distributed/nodes.py),
so the world group spans nodes and shared memory carries nothing.

Per precision, "plain" (zero_quantized_gradients false) and "qgz" (true)
each run one untimed step, then --steps counted ones. Reported per step,
from the comms logger (dsrun/runtime/comm/logger.py):
- the gradients' logical reduce-scatter (region elements x the dtype
  a plain reduce-scatter sends: fp32 or bf16), the same in both runs;
- the bytes the gradient collectives actually sent, as message bytes
  (DeepSpeed's convention: the input of each collective), bus bytes (what
  each rank puts on the wire, nccl-tests' convention) and the inter-node
  part of the bus bytes (the paper's accounting: a collective whose group
  spans nodes counts whole). plain: on gloo dsrun reduce-scatters with an
  all_reduce of the region (comm/collectives.py [Note: choosing the
  collective per backend]), so its gradient traffic is the all_reduce
  traffic of the plain run minus that of the qgz run (the parameter
  all-gathers, the loss and the norm are the same in both); qgz: the two
  all_to_all_single calls per region;
- "rs-equivalent": the bus bytes a bandwidth-optimal reduce-scatter of the
  same region would send ((p-1)/p of the message), the figure the paper
  compares against;
- the losses of both runs.
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


def _rank(model_name: str, precision: str, quantized: bool, steps: int) -> dict:
    as_nodes(PER_NODE)
    import dsrun
    from dsrun.runtime import comm

    s = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(s)
    cfg = {"train_micro_batch_size_per_gpu": s.micro, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": s.bucket,
                                 "zero_quantized_gradients": quantized}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    losses, stats = counted_steps(engine, s, comm.get_rank(), 1, steps)
    return {"losses": losses,
            "ops": {op: (st.bytes, st.bus_bytes, st.inter_node_bus_bytes) for op, st in stats.items()}}


def _per_step(ops: dict, op: str, steps: int) -> tuple[float, float, float]:
    return tuple(v / steps for v in ops.get(op, (0, 0, 0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precisions", default="fp32,bf16")
    args = parser.parse_args()
    mib = 2 ** 20
    print(f"model {args.model}, stage 3, {WORLD} ranks as {WORLD // PER_NODE} nodes x {PER_NODE}, "
          f"{args.steps} counted steps; MiB per step per rank")
    for precision in args.precisions.split(","):
        res = {name: run_ranks(_rank, WORLD, args.model, precision, q, args.steps, timeout=3600)
               for name, q in (("plain", False), ("qgz", True))}
        plain, qgz = res["plain"][0]["ops"], res["qgz"][0]["ops"]
        logical = _per_step(plain, "logical_reduce_scatter", args.steps)[0]
        ar_plain, ar_qgz = _per_step(plain, "all_reduce", args.steps), _per_step(qgz, "all_reduce", args.steps)
        grad_plain = tuple(a - b for a, b in zip(ar_plain, ar_qgz))
        grad_qgz = _per_step(qgz, "all_to_all_single", args.steps)
        rs_bus = logical * (WORLD - 1) / WORLD
        print(f"\n{precision}: gradients' logical reduce-scatter {logical / mib:.3f} MiB per step "
              f"(reduce-scatter-equivalent bus {rs_bus / mib:.3f}, all of it inter-node)")
        print(f"{'run':<6} {'message':>9} {'bus':>9} {'inter-node bus':>15}")
        for name, (msg, bus, inter) in (("plain", grad_plain), ("qgz", grad_qgz)):
            print(f"{name:<6} {msg / mib:9.3f} {bus / mib:9.3f} {inter / mib:15.3f}")
        print(f"ratios plain/qgz: message {grad_plain[0] / grad_qgz[0]:.2f}x, bus {grad_plain[1] / grad_qgz[1]:.2f}x, "
              f"inter-node bus {grad_plain[2] / grad_qgz[2]:.2f}x; against the reduce-scatter-equivalent: "
              f"bus {rs_bus / grad_qgz[1]:.2f}x, inter-node {rs_bus / grad_qgz[2]:.2f}x")
        print(f"all ops, bus per step: plain {sum(v[1] for v in plain.values()) / args.steps / mib:.3f}, "
              f"qgz {sum(v[1] for v in qgz.values()) / args.steps / mib:.3f}; inter-node: plain "
              f"{sum(v[2] for v in plain.values()) / args.steps / mib:.3f}, "
              f"qgz {sum(v[2] for v in qgz.values()) / args.steps / mib:.3f}")
        for name in ("plain", "qgz"):
            print(f"losses {name:<5}", " ".join(f"{x:.4f}" for x in res[name][0]["losses"]))


if __name__ == "__main__":
    main()

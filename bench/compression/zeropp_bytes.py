"""Bytes per step within and across nodes for ZeRO-3 and ZeRO++ (hpZ, qwZ, qgZ), 2 nodes x 2 ranks.

    .venv/bin/python bench/compression/zeropp_bytes.py [--model small|48m] [--warmup 2] [--steps 2]
        [--runs stage3,hpz,hpz-qwz,qwz]

4 ranks on this machine made 2 nodes of 2 through the rank environment
(LOCAL_RANK = RANK mod 2, LOCAL_WORLD_SIZE = 2; dsrun/runtime/distributed/nodes.py), gloo.
The bytes are the comms logger's (dsrun/runtime/comm/logger.py): bus bytes
each rank sends per step (nccl-tests' convention), split into intra-node
and inter-node by the group of each collective ([Note: intra-node and
inter-node bytes]: a collective whose group spans nodes counts across nodes
whole, the ZeRO++ paper's accounting). They depend on the model and the
configuration only, not on the link or the machine's load, so one run
after --warmup steps is exact; a link-level measurement over SSH with a
throttled link is bench/compression/two_node_step.py.

Model: the GPT of bench/step_time/gpt_step.py (`small`: d=256, 4 layers,
vocab 8000; `48m`), fp32, "AdamW", stage 3 with
stage3_param_persistence_threshold 0 and stage3_max_reuse_distance 0 (every
unit is gathered for forward and again for backward, as the paper counts).
Configurations: stage3 (plain), hpz (zero_hpz_partition_size 2), qwz
(zero_quantized_weights), hpz-qwz, and where dsrun accepts them qgz
(zero_quantized_gradients) and zpp (all three).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step_time"))

import torch  # noqa: E402

from counted import counted_steps  # noqa: E402
from gpt_step import GPT, MODELS  # noqa: E402  (the same model as the other benchmarks)

RUNS = {
    "stage3": {},
    "hpz": {"zero_hpz_partition_size": 2},
    "qwz": {"zero_quantized_weights": True},
    "hpz-qwz": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True},
    "qgz": {"zero_quantized_gradients": True},
    "zpp": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True},
}
WORLD, PER_NODE = 4, 2


def _rank(run: str, s, warmup: int, steps: int, rank: int, port: int, out) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % PER_NODE), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(PER_NODE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    import dsrun

    model = GPT(s)
    numel = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": s.micro, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, **RUNS[run]}}
    engine, *_ = dsrun.initialize(model=model, config=config)
    losses, stats = counted_steps(engine, s, rank, warmup, steps)
    per_op = {op: (st.bus_bytes / steps, st.inter_node_bus_bytes / steps) for op, st in stats.items()
              if st.bus_bytes}
    secondary = sum(engine.memory_breakdown().get("hpz_secondary", {}).values())
    out.put((rank, per_op, losses, secondary, numel))
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(*args) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(*args, r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = []
    while len(results) < WORLD:
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{args[0]}: a rank failed (traceback above)")
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r[0])


def _mib(b: float) -> str:
    return f"{b / 2**20:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--runs", default="stage3,hpz,hpz-qwz,qwz")
    args = ap.parse_args()
    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"unknown configuration {unknown[0]!r}; known: {', '.join(RUNS)}")
    s = MODELS[args.model]
    rows, base = [], None
    for run in runs:
        results = _launch(run, s, args.warmup, args.steps)
        per_op, losses, secondary, numel = results[0][1:]
        if any(r[1] != per_op for r in results):
            print(f"note: {run}: the ranks' bytes differ; rank 0's are shown")
        inter = sum(v[1] for v in per_op.values())
        total = sum(v[0] for v in per_op.values())
        base = inter if base is None else base
        ops = ", ".join(f"{op} {_mib(v[1])}/{_mib(v[0] - v[1])}" for op, v in sorted(per_op.items()))
        rows.append(f"| {run} | {_mib(inter)} | {inter / base:.3f} | {_mib(total - inter)} | {_mib(secondary)} | "
                    f"{losses[-1]:.6f} | {ops} |")
    print(f"GPT {args.model} ({numel / 1e6:.2f}M parameters), 2 nodes x 2 ranks, fp32, stage 3, "
          f"bytes per rank per step over {args.steps} steps after {args.warmup} (rank 0)")
    print("| run | inter-node MiB/step | vs stage3 | intra-node MiB/step | hpZ secondary MiB | last loss (rank 0) "
          "| per op: inter/intra MiB |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

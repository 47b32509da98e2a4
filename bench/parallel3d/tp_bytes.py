"""Pipeline x tensor x sequence x data (x experts) parallelism of the byte GPT: bytes per mesh axis, peak memory, step time.

    .venv/bin/python bench/parallel3d/tp_bytes.py --repeats 3 --steps 3
    .venv/bin/python bench/parallel3d/tp_bytes.py --world 8 --runs dp8,pp2tp2sp2dp1 --hidden 128 --heads 4 --seq 64
    .venv/bin/python bench/parallel3d/tp_bytes.py --world 8 --runs dp8moe,pp2tp2dp2moe --hidden 128 --heads 4 --seq 64

Each configuration trains examples/gpt_model.py's GPT (fp32, AdamW from
ds_config, ZeRO stage 0, gradient clipping 1.0) on random bytes with the
same global batch per step: micro-batch `--micro` windows of `--seq` bytes
on every rank, data-parallel replicas x gradient accumulation = `--world`.

- `dpN`: N-way data parallelism, the model whole on every rank;
- `tpTdpD`: `dsrun.tp_model_init(model, T)` (AutoTP: qkv and fc
  column-parallel, the attention and MLP output projections row-parallel,
  embeddings, LayerNorms and head replicated) x D data-parallel replicas,
  each replica accumulating world / D micro-batches;
- `ppPtpTdpD`: the GPT as a P-stage PipelineModule (examples/gpt_pipe.py's
  layers, on the pipe x model x data mesh's topology, `train_batch` over
  world / D micro-batches, 1F1B) whose blocks are then split by the same
  placement (`shard_model`: ColumnParallelLinear / RowParallelLinear
  from the GPT's full weights; docs/pipeline.md "With tensor parallelism").
- `ppPtpTspSdpD`: the same with Ulysses over S sequence ranks in every
  block (examples/gpt_sequence.py's sequence_parallel_pipeline, each rank
  fed its (b, s/S) slice of the windows; configs/gpt_4d.json's layout);
- a trailing `moe`: examples/gpt_moe.py's MoE GPT (4 experts, top-1, in the
  odd blocks, at ep 2 over the data axis; as a pipeline moe_gpt_pipeline,
  its gates and experts kept whole over the tensor ranks;
  configs/gpt_3d_moe.json's layout).

Bytes per mesh axis. Every collective goes through
dsrun/runtime/comm/collectives.py, which counts it in the comms logger
(`comms_logger.record`: message bytes, the full tensor). This script wraps
the two functions that issue them (`_issue`, `_overlapped`) to note the
process group of the call in progress and `record` to add each counted
message to the axis of that group (the mesh axis whose ranks the group's
ranks are); the per-axis sums are checked against the logger's own total.
Counted over the timed steps, divided by their number.

The pipeline's point-to-point messages (pipe/p2p.py) are counted by the
logger as "isend"/"irecv" outside those two functions and put on the
"pipe" axis by their name; with 2 stages each rank sends one (b, s, h)
per micro-batch (an activation forward or its gradient back) and receives
one. One-element messages (gradient norms, overflow flags, the pipeline's
shape announcements) are listed apart.

Analytic counts per step (Shoeybi et al. 2019, Section 3): per transformer
layer and micro-batch, Megatron's f and g operators all-reduce the (b, s, h)
activation twice in forward (attention and MLP outputs, g) and twice in
backward (their inputs' gradients, f): 4 b s h elements, times the element
size (4, fp32), times the layers and the micro-batches of the step. The
data axis all-reduces each rank's gradients once per step (ZeRO stage 0):
parameters per rank x 4 bytes. Gradient clipping adds one-element norm
all-reduces (listed separately, as "scalars"). With S sequence ranks each
rank holds s/S tokens: the model axis's activations are b (s/S) h, and
Ulysses all-to-alls, per layer and micro-batch, q, k and v (3 b s h / (S T)
elements, one message) and the attention output (b s h / (S T)) forward and
the same backward: 8 b s h / (S T) elements; the gradients are all-reduced
over the sequence x data ranks ("sequence_data"). An MoE layer all-to-alls
its dispatched tokens (E, C, h), C = ceil(b s / E) slots per expert, twice
forward and twice backward over its expert-parallel group ("ep"): 4 E C h
elements per micro-batch; its experts' gradients are all-reduced over the
expert-data group ("expert_data"), the other parameters over the data axis.
With tensor parallelism an MoE block's MLP stays whole (AutoTP keeps its
gate and experts replicated), so the block all-reduces over the model axis
twice per micro-batch (its attention's), not 4 times.

Peak memory per rank: VmHWM of /proc/self/status over the timed steps,
reset after warm-up (clear_refs 5). The formula beside it: model states
are 16 bytes per parameter (fp32 weight, gradient, Adam m and v), so the
drop from dpN to tpT is 16 x (parameters of dpN's rank - of tpT's rank) =
16 x (1 - 1/T) x (the parameters of the sharded layers). Activations
kept for backward whose last dimension is split fall too: per layer and
micro-batch about 12 b s h fp32 values (q/k/v 3h, the attention output h,
fc's output and the GELU's 4h each), of which a rank keeps 1/T; the table
gives that drop, 48 b s h L (1 - 1/T) bytes, beside (one micro-batch is
live at a time without a pipeline; with one, the formula is not applied).
The tied embedding's gradient is all-reduced between the first and last
stage of a pipeline (the "pipe" axis): 256 x h x 4 bytes.

Step time: the slowest rank's wall time from a barrier to the step's end
(a barrier after it), per timed step; launches interleaved (A B, A B, ...),
each a fresh set of processes (tests/dist_helpers.run_ranks), 1 torch
thread per rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from tests.dist_helpers import run_ranks

ELEMENT = 4  # fp32 bytes


@dataclasses.dataclass(frozen=True)
class Run:
    """One configuration: `pp` stages x `tp` tensor-parallel ranks x `sp`
    sequence-parallel ranks x `dp` data-parallel replicas; `moe`: the MoE GPT."""
    name: str
    pp: int
    tp: int
    dp: int
    sp: int = 1
    moe: bool = False


EXPERTS, EP_SIZE = 4, 2  # the MoE runs' experts (top-1) and expert-parallel degree


def parse_run(name: str, world: int) -> Run:
    """`[ppP][tpT][spS]dpD[moe]` with P x T x S x D = world."""
    m = re.fullmatch(r"(?:pp(\d+))?(?:tp(\d+))?(?:sp(\d+))?dp(\d+)(moe)?", name)
    if not m:
        raise SystemExit(f"run {name!r}: write [ppP][tpT][spS]dpD[moe], e.g. dp4, tp2dp2, pp2tp2sp2dp1, pp2tp2dp2moe")
    run = Run(name, int(m.group(1) or 1), int(m.group(2) or 1), int(m.group(4)), int(m.group(3) or 1),
              bool(m.group(5)))
    if run.pp * run.tp * run.sp * run.dp != world:
        raise SystemExit(f"run {name!r}: pp x tp x sp x dp = {run.pp * run.tp * run.sp * run.dp}, not --world {world}")
    if run.sp > 1 and run.pp == 1:
        raise SystemExit(f"run {name!r}: sequence parallelism is measured inside a pipeline only (ppP...spS...)")
    return run


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


class AxisBytes:
    """Per mesh axis and op, the message bytes the comms logger counts."""

    def __init__(self, mesh, world: int) -> None:
        import torch.distributed as dist

        self.dist, self.world = dist, world
        # later axes win where two have the same ranks (pipe_model is model without a pipeline)
        self.axes = {tuple(mesh.ranks(a)): a if len(mesh.ranks(a)) > 1 else f"{a} (1 rank)"
                     for a in ("pipe_model", "pipe", "sequence_data", "data", "sequence", "model")}
        if EP_SIZE <= mesh.size("data"):  # the MoE runs' expert groups (mesh.data_blocks)
            blocks = mesh.data_blocks(EP_SIZE)
            for label, group in (("expert_data", blocks.replicate), ("ep", blocks.block)):
                ranks = tuple(sorted(group.ranks))
                if len(ranks) == 1:  # a one-rank expert-data group: name it by its use
                    self.axes[ranks] = f"{label} (1 rank)"
                self.axes.setdefault(ranks, label)
        self.current: str | None = None
        self.bytes: dict[tuple[str, str], int] = {}
        self.scalars: dict[str, int] = {}

    def axis_of(self, group) -> str:
        ranks = (tuple(range(self.world)) if group is None
                 else tuple(sorted(self.dist.get_process_group_ranks(group))))
        return self.axes.get(ranks, f"ranks {list(ranks)}")

    def install(self) -> None:
        from dsrun.runtime.comm import collectives

        logger = collectives.comms_logger
        record, issue, overlapped = logger.record, collectives._issue, collectives._overlapped

        def on_record(op, tensor, *a, **k):
            # the pipeline's sends and receives (pipe/p2p.py) are counted outside _issue
            axis = self.current or ("pipe" if op in ("isend", "irecv") else "?")
            if tensor.numel() == 1:
                self.scalars[axis] = self.scalars.get(axis, 0) + tensor.element_size()
            else:
                self.bytes[(axis, op)] = self.bytes.get((axis, op), 0) + tensor.numel() * tensor.element_size()
            return record(op, tensor, *a, **k)

        def with_group(fn):
            def wrapped(name, counted, group, *a, **k):
                outer, self.current = self.current, self.axis_of(group)
                try:
                    return fn(name, counted, group, *a, **k)
                finally:
                    self.current = outer
            return wrapped

        logger.record = on_record
        collectives._issue, collectives._overlapped = with_group(issue), with_group(overlapped)

    def reset(self) -> None:
        self.bytes.clear()
        self.scalars.clear()


def _rank(run: Run, args: argparse.Namespace) -> dict:
    """One rank of `run`: parameters, per-axis bytes and step times over the timed steps, peak RSS."""
    import torch.distributed as dist
    from gpt_model import GPT, GPTConfig

    import dsrun
    from dsrun.runtime.comm import comms_logger
    from dsrun.runtime.parallel.mesh import ParallelMesh, current, set_current
    from dsrun.runtime.parallel.tensor.autotp import shard_model

    torch.set_num_threads(1)
    dsrun.init_distributed()
    world = dist.get_world_size()
    torch.manual_seed(0)
    gpt_cfg = GPTConfig(seq_len=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.hidden)
    if run.pp > 1:  # the mesh before the model: the MoE layers' expert groups live on its data axis
        mesh = ParallelMesh.build(world, pipe=run.pp, model=run.tp, sequence=run.sp)
        set_current(mesh)
    if run.moe:
        from gpt_moe import MoEGPT, moe_gpt_pipeline

        from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer
        model = MoEGPT(gpt_cfg, EXPERTS, EP_SIZE)
    else:
        model = GPT(gpt_cfg)
    total_params = sum(p.numel() for p in model.parameters())
    accum = world // run.dp
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": accum,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0, "steps_per_print": 10**9}
    if run.pp > 1:
        from gpt_pipe import (
            TIED_KEY,
            Block,
            PositionEmbedding,
            lm_loss,
            load_gpt_weights,
            logits,
            param_groups,
        )

        from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec

        if run.moe:
            pipe = moe_gpt_pipeline(gpt_cfg, run.pp, EXPERTS, EP_SIZE, topology=mesh.topology)
        else:
            layers = [TiedLayerSpec(TIED_KEY, torch.nn.Embedding, 256, args.hidden),
                      LayerSpec(PositionEmbedding, gpt_cfg), *[LayerSpec(Block, gpt_cfg) for _ in range(args.layers)],
                      LayerSpec(torch.nn.LayerNorm, args.hidden),
                      TiedLayerSpec(TIED_KEY, torch.nn.Embedding, 256, args.hidden, forward_fn=logits)]
            pipe = PipelineModule(layers, loss_fn=lm_loss, topology=mesh.topology, partition_method="type:Block")
        load_gpt_weights(pipe, model)
        del model
        shard_model(pipe, mesh)  # every rank holds the GPT's full weights: cut this rank's slices
        if run.sp > 1:
            from gpt_sequence import sequence_parallel_pipeline
            sequence_parallel_pipeline(pipe)
        groups = param_groups(pipe)
        engine, *_ = dsrun.initialize(model=pipe, config=cfg, model_parameters=(
            split_params_into_different_moe_groups_for_optimizer(groups) if run.moe else groups))
        if run.sp > 1:
            from gpt_sequence import shard_window
            engine.set_batch_fn(shard_window)
    else:
        if run.tp > 1:
            dsrun.tp_model_init(model, run.tp)
        groups = model.param_groups()
        engine, *_ = dsrun.initialize(model=model, config=cfg, model_parameters=(
            split_params_into_different_moe_groups_for_optimizer(groups) if run.moe else groups))
    mesh = current()
    data_rank = mesh.rank("data")
    counter = AxisBytes(mesh, world)
    counter.install()
    sharded = sum(p.numel() for p in engine.module.parameters() if getattr(p, "tensor_model_parallel", False))
    params = sum(p.numel() for p in engine.module.parameters())
    expert_params = sum(p.numel() for p in engine.module.parameters() if getattr(p, "allreduce", True) is False)
    moe_layers = sum(type(m).__name__ == "MOELayer" for m in engine.module.modules())

    def batch(i: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * i + 1009 * data_rank + j)
        tokens = torch.randint(0, 256, (args.micro, args.seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def step(i: int) -> None:
        if run.pp > 1:
            engine.train_batch(iter([batch(i, j) for j in range(accum)]))
            return
        for j in range(accum):
            engine.backward(engine(*batch(i, j)))
            engine.step()

    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS: the timed steps' own peak
            counter.reset()
            comms_logger.reset()
        dist.barrier()
        t0 = time.perf_counter()
        step(i)
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    logged = comms_logger.totals()[0]
    return {"params": params, "sharded": sharded, "expert_params": expert_params, "moe_layers": moe_layers, "total_params": total_params, "accum": accum,
            "bytes": {f"{a}/{op}": b / args.steps for (a, op), b in counter.bytes.items()},
            "scalars": {a: b / args.steps for a, b in counter.scalars.items()},
            "counted": (sum(counter.bytes.values()) + sum(counter.scalars.values())) / args.steps,
            "logged": logged / args.steps, "times": times, "hwm_mib": _vm_hwm_mib()}


def _ms(x: float) -> str:
    return f"{x * 1000:.0f}"


def _analytic(key: str, r: Run, rk: dict, args: argparse.Namespace) -> float | None:
    """The module docstring's count for one rank's `key` ("axis/op"), bytes per step, or None."""
    # one (b, s/S, h) per micro-batch of the step
    bsh = args.micro * args.seq * args.hidden * rk["accum"] * ELEMENT // r.sp
    axis, op = key.split("/")
    if (axis, op) == ("model", "all_reduce"):  # an MoE block's MLP is whole: its attention's 2 only
        return (4 * (args.layers // r.pp) - 2 * rk["moe_layers"]) * bsh
    if axis in ("data", "sequence", "sequence_data") and op == "all_reduce":
        return (rk["params"] - rk["expert_params"]) * ELEMENT
    if axis.startswith("expert_data") and op == "all_reduce":
        return rk["expert_params"] * ELEMENT
    if axis == "sequence" and op.startswith("all_to_all"):  # Ulysses: q, k, v and the output, forward and backward
        return 8 * (args.layers // r.pp) * bsh // r.tp
    if r.moe and axis in ("ep", "data") and op.startswith("all_to_all"):  # dispatch and combine, twice each
        slots = math.ceil(args.micro * args.seq / EXPERTS)
        return 4 * EXPERTS * slots * args.hidden * ELEMENT * rk["moe_layers"] * rk["accum"]
    if (axis, op) == ("pipe", "all_reduce"):  # the tied embedding, first and last stage
        return 256 * args.hidden * ELEMENT
    if (axis, op) in (("pipe", "isend"), ("pipe", "irecv")):  # 2 stages: an activation one way, its gradient back
        return bsh
    return None


def _range(values: list[float], scale: float = 1e6, fmt: str = ".4f") -> str:
    lo, hi = min(values) / scale, max(values) / scale
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}-{hi:{fmt}}"


def report(runs: list[Run], results: dict[str, list[list[dict]]], args: argparse.Namespace) -> None:
    """Print the bytes, memory and time tables (markdown)."""
    b, s, h, L = args.micro, args.seq, args.hidden, args.layers
    print(f"\nGPT: {L} layers, hidden {h}, {args.heads} heads, seq {s}, vocab 256; micro-batch {b} per rank, "
          f"global batch {b * args.world} windows; {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.repeats} launches per run\n")
    print("| run | axis | op | measured MB/step/rank | analytic MB/step/rank | measured / analytic |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        for launch in results[r.name]:
            for rk in launch:
                assert abs(rk["counted"] - rk["logged"]) <= 1e-6 * max(rk["logged"], 1), (rk["counted"], rk["logged"])
        ranks = [rk for launch in results[r.name] for rk in launch]
        keys = sorted({k for rk in ranks for k in rk["bytes"]})
        for key in keys:
            vals = [rk["bytes"].get(key, 0.0) for rk in ranks]
            wanted = [_analytic(key, r, rk, args) for rk in ranks]
            axis, op = key.split("/")
            if None in wanted:
                print(f"| {r.name} | {axis} | {op} | {_range(vals)} | - | - |")
                continue
            ratios = [v / w for v, w in zip(vals, wanted)]
            print(f"| {r.name} | {axis} | {op} | {_range(vals)} | {_range(wanted)} | {_range(ratios, 1, '.4f')} |")
        scal = {a: v for rk in ranks[:1] for a, v in rk["scalars"].items()}
        if scal:
            print(f"| {r.name} | {' / '.join(sorted(scal))} | one-element messages (norms, flags), rank 0 | "
                  f"{' / '.join(f'{scal[a]:.0f} B' for a in sorted(scal))} | - | - |")
    base = runs[0]
    base_rss = statistics.median(rk["hwm_mib"] for launch in results[base.name] for rk in launch)
    base_params = results[base.name][0][0]["params"]
    print(f"\n| run | parameters per rank (M) | of them sharded (M) | peak RSS per rank, median (min-max) MiB "
          f"| RSS drop vs {base.name} MiB | formula 16 B x parameter drop MiB | formula + activations 48 b s h L (1 - 1/T) MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        rss = [rk["hwm_mib"] for launch in results[r.name] for rk in launch]
        first = results[r.name][0][0]
        med = statistics.median(rss)
        drop = 16 * (base_params - first["params"]) / 2**20
        act = f"{drop + 48 * b * s * h * L * (1 - 1 / r.tp) / 2**20:.0f}" if r.pp == 1 else "-"
        print(f"| {r.name} | {first['params'] / 1e6:.3f} | {first['sharded'] / 1e6:.3f} | "
              f"{med:.0f} ({min(rss):.0f}-{max(rss):.0f}) | {base_rss - med:.0f} | {drop:.0f} | {act} |")
    print("\n| run | ms/step min | median | spread (max-min)/median | launches x steps |")
    print("|---|---|---|---|---|")
    for r in runs:
        steps = [max(rk["times"][i] for rk in launch) for launch in results[r.name]
                 for i in range(len(launch[0]["times"]))]
        med = statistics.median(steps)
        print(f"| {r.name} | {_ms(min(steps))} | {_ms(med)} | {(max(steps) - min(steps)) / med:.0%} | "
              f"{len(results[r.name])} x {args.steps} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--runs", default="dp4,tp2dp2", help="comma-separated dpN / tpTdpD, the first is the baseline")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4, help="windows per micro-batch per rank")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    args = ap.parse_args()
    runs = [parse_run(n, args.world) for n in args.runs.split(",")]
    os.environ["OMP_NUM_THREADS"] = "1"
    results: dict[str, list] = {r.name: [] for r in runs}
    load_before = os.getloadavg()[0]
    for rep in range(args.repeats):
        for r in runs:  # interleaved: A B, A B, ...
            t0 = time.perf_counter()
            launch = run_ranks(_rank, args.world, r, args, timeout=args.timeout)
            results[r.name].append(launch)
            print(f"[repeat {rep + 1}/{args.repeats}] {r.name}: launch {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    print(f"load average (1 min) {load_before:.1f} before the launches, {os.getloadavg()[0]:.1f} after; "
          f"{os.cpu_count()} CPUs")
    report(runs, results, args)


if __name__ == "__main__":
    main()

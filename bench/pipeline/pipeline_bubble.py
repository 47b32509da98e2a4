"""Pipeline parallelism on 4 ranks: each schedule's measured bubble beside
its theory, peak memory per stage and the step time beside pure data
parallelism of the same model and global batch.

    .venv/bin/python bench/pipeline/pipeline_bubble.py [--model bench|bench-v256|48m] [--repeats 2] [--warmup 1]
        [--steps 3] [--global_micro_batches 8] [--virtual 2]
        [--runs dp,p2-1f1b,p2-interleaved,p2-zb-h1,p4-1f1b,p4-interleaved,p4-zb-h1] [--torch_adam]

Model: the GPT of bench/step_time/gpt_step.py (its `Block`), built as a
PipelineModule of LayerSpecs: the embedding (token + position) first, the
blocks, then the head (final LayerNorm + vocabulary projection, untied: no
tied weights cross stages here), loss = cross-entropy. Partitioned with
"type:Block", so every part holds the same number of blocks; the first part
also holds the embedding and the last the head. `--model 48m` is the 48M
GPT's shape (d=512, 10 blocks, vocab 32000, seq 256; 64M parameters with the
head untied); the default `bench` (d=256, 8 blocks, 4 heads, vocab 2048,
seq 256, micro-batch 2; 7.4M parameters) keeps 4 ranks on this 2-core
machine within minutes and makes the head (the heaviest layer of the 48M
model, about 2.5 blocks of compute) about 0.6 of a block, so the last part
is less unbalanced; the bubble formulas assume equal parts, which
`--model bench-v256` (vocab 256: a head of about a tenth of a block) comes
closer to.

Configurations, all on 4 ranks x 1 torch thread, fp32, ZeRO stage 0, AdamW
(ds_config's, dsrun's CPU Adam), the same global batch of
`--global_micro_batches` (G) micro-batches per step:
- dp: dsrun.initialize on the same layers as an nn.Sequential, 4-way data
  parallel, gradient_accumulation_steps G/4;
- pP-SCHED: P pipeline stages x 4/P data-parallel replicas, schedule SCHED
  ("1f1b", "interleaved" with `--virtual` chunks per rank, "zb-h1"),
  m = G/(4/P) micro-batches per pipeline per step.
DeepSpeed's PipelineEngine would be a column if the real `deepspeed`
package were installed; it is not on this machine (the script says which).

Each launch is a fresh set of 4 processes (tests/dist_helpers.run_ranks)
running `--warmup` untimed then `--steps` timed steps, a step (train_batch,
or G/4 forward/backward/step calls for dp) timed between barriers.
Configurations are interleaved (A B C ..., A B C ...) over `--repeats`.

Reported per configuration, over all timed steps of all repeats:
- step time: min / median / spread ((max - min) / median), median ratio to
  dp, and the CPU seconds of a step summed over the ranks (median over
  steps): the work done, which the machine's load moves far less than the
  wall time;
- bubble per stage, from `engine.last_bubble` of each rank:
  "own" = wait_s / schedule_s (the time this rank was blocked on its
  neighbours over its own schedule, which ends at its last backward);
  "span" = 1 - busy / (the slowest rank of its pipeline's schedule_s), busy =
  schedule_s - wait_s: idle over the pipeline's makespan, the papers'
  definition, which also counts the wait after a stage's last backward
  until the pipeline's last one ends. Medians over steps, averaged over data
  replicas; the table gives their mean over stages, then per stage;
- theory: `theoretical_bubble` (F = B = W, the papers' setting), and
  `simulate` of dsrun's schedules with the same costs read both ways ("own",
  "span"); "step / 1f1b": the median step over 1F1B's at the same depth,
  measured and simulated (F = B = W; dsrun's weight pass runs only the
  weight-gradient products, engine/pipeline_engine.py [Note: zero bubble's split
  backward], so W costs about F);
- peak memory per stage: VmHWM of /proc/self/status (peak resident set)
  over the timed steps, reset at the end of warm-up (clear_refs 5), the
  largest over data replicas and repeats; ru_maxrss (the whole process) too;
- CPU share: the rank's CPU seconds over its busy (non-waiting) wall time in
  the schedule: below 1 when ranks outnumber cores and a runnable rank waits
  for one;
- replay (pipeline runs): what the step would take with a core per rank,
  from work the machine's load moves little. Every timed step runs with
  `engine.action_timing`, which records each action's CPU time on the
  executor's thread; per stage, the median CPU seconds of one Forward,
  Backward, BackwardInput and BackwardWeight (over steps, repeats and data
  replicas) become the costs of `simulate(..., rank_costs=...)` of the
  rank's own schedule (sends and receives free, no latency). Reported: the
  replayed schedule time (CPU s), its bubble (idle over makespan, the
  papers' definition) over the paper's, and its step over 1F1B's replayed
  step at the same depth; beside them the paper's bubble with the measured
  passes (ZB-H1's (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)) with F, BI, BW
  the stages' mean CPU seconds; 1F1B's and interleaved's do not depend on
  the costs), and the replay on this machine's shape: the WORLD ranks
  sharing CORES cores (`simulate_on_cores`: while n ranks have work each
  runs at min(1, cores / n) of a core), where an idle rank's core goes to a
  busy one and only the moments with fewer busy ranks than cores are lost.
  It is a model fed with measurements, not a measured wall time: it leaves
  out the messages' latency and the executor's work between actions.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn
from torch.nn import functional as F

from bench.step_time.gpt_step import LR, WEIGHT_DECAY, Block, Shape
from tests.dist_helpers import run_ranks

WORLD = 4
CORES = 2  # the machine these runs were sized for: 4 ranks time-share 2 cores (the replay on cores)
MODELS = {
    "48m": Shape(d=512, layers=10, heads=8, vocab=32000, seq=256, micro=2, bucket=5_000_000),
    "bench": Shape(d=256, layers=8, heads=4, vocab=2048, seq=256, micro=2, bucket=5_000_000),
    # the bench model with a 256-word vocabulary: the head costs about a tenth of a block, the stages are near equal
    "bench-v256": Shape(d=256, layers=8, heads=4, vocab=256, seq=256, micro=2, bucket=5_000_000),
}
SCHEDULES = ("1f1b", "interleaved", "zb-h1")
RUNS = ("dp", *(f"p{p}-{s}" for p in (2, 4) for s in SCHEDULES))
BUBBLE_KEYS = ("own", "span", "cpu_share", "wait_s", "busy_s")  # what step_bubbles gives per rank and step


class Embed(nn.Module):
    """Token + position embedding: (B, T) int64 -> (B, T, d) fp32."""

    def __init__(self, s: Shape):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(s.vocab, s.d), nn.Embedding(s.seq, s.d)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.size(1)))


class Head(nn.Module):
    """Final LayerNorm and vocabulary projection: (B, T, d) -> logits (B, T, vocab)."""

    def __init__(self, s: Shape):
        super().__init__()
        self.ln_f, self.proj = nn.LayerNorm(s.d), nn.Linear(s.d, s.vocab, bias=False)

    def forward(self, x):
        return self.proj(self.ln_f(x))


def lm_loss(logits, targets):
    """Mean cross-entropy of logits (B, T, vocab) against targets (B, T) int64."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def layer_specs(s: Shape) -> list:
    """The GPT as LayerSpecs: embedding, `s.layers` blocks, head."""
    from dsrun.pipe import LayerSpec

    return [LayerSpec(Embed, s), *(LayerSpec(Block, s) for _ in range(s.layers)), LayerSpec(Head, s)]


@dataclasses.dataclass(frozen=True)
class Run:
    """One configuration: `stages` pipeline stages (1: pure data parallelism)."""

    name: str
    stages: int
    schedule: str | None
    virtual: int

    @property
    def data(self) -> int:
        return WORLD // self.stages


def parse_run(name: str, virtual: int) -> Run:
    """"dp" or "pP-SCHED" -> Run. Raises SystemExit for another name."""
    if name == "dp":
        return Run(name, 1, None, 1)
    head, _, sched = name.partition("-")
    if head in ("p2", "p4") and sched in SCHEDULES:
        return Run(name, int(head[1:]), sched, virtual if sched == "interleaved" else 1)
    raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(RUNS)}")


def _micro_batch(s: Shape, step: int, data_rank: int, j: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * data_rank + j)
    tokens = torch.randint(0, s.vocab, (s.micro, s.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _vm_hwm_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:"))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(run: Run, s: Shape, global_micro: int, warmup: int, steps: int, torch_adam: bool) -> dict:
    """One rank of `run`: its stage, data rank and per timed step the step
    time, last_bubble and CPU seconds; its peak RSS."""
    import torch.distributed as dist

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed

    init_distributed()
    torch.manual_seed(0)
    micro_batches = global_micro // run.data
    adamw = {"lr": LR, "weight_decay": WEIGHT_DECAY, **({"torch_adam": True} if torch_adam else {})}
    cfg = {"train_micro_batch_size_per_gpu": s.micro, "gradient_accumulation_steps": micro_batches,
           "optimizer": {"type": "AdamW", "params": adamw},
           "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0, "steps_per_print": 10**9}
    if run.stages > 1:
        module = PipelineModule(layer_specs(s), num_stages=run.stages, loss_fn=lm_loss,
                                partition_method="type:Block", virtual_stages=run.virtual)
        cfg["pipeline"] = {"schedule": run.schedule, "virtual_stages": run.virtual}
        engine, *_ = dsrun.initialize(model=module, config=cfg)
        stage, data_rank = engine.stage_id, engine.grid.get_data_parallel_rank()

        def step(i):
            engine.train_batch(iter([_micro_batch(s, i, data_rank, j) for j in range(micro_batches)]))
    else:
        model = nn.Sequential(*(spec.build() for spec in layer_specs(s)))
        engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        stage, data_rank = 0, dist.get_rank()

        def step(i):
            for j in range(micro_batches):
                x, y = _micro_batch(s, i, data_rank, j)
                engine.backward(lm_loss(engine(x), y))
                engine.step()
    params = sum(p.numel() for p in engine.module.parameters())
    rows = []
    for i in range(warmup + steps):
        if run.stages > 1:
            engine.action_timing = i >= warmup  # CPU time per action, for the replay
        if i == warmup:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS: the timed steps' own peak
        dist.barrier()
        t0, c0 = time.perf_counter(), _cpu_s()
        step(i)
        c1 = _cpu_s()
        dist.barrier()
        if i >= warmup:
            bubble = getattr(engine, "last_bubble", {})
            rows.append({"step_s": time.perf_counter() - t0, "cpu_s": c1 - c0,
                         "wait_s": bubble.get("wait_s", 0.0), "schedule_s": bubble.get("schedule_s", 0.0),
                         "actions": getattr(engine, "last_action_times", {})})
    return {"stage": stage, "data": data_rank, "params": params, "steps": rows, "hwm_mib": _vm_hwm_mib(),
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def step_bubbles(ranks: list[dict], step: int) -> list[dict]:
    """Per rank for timed step `step`: "own" = wait_s / schedule_s and
    "span" = 1 - busy / max(schedule_s over the ranks of its pipeline, i.e.
    the same data rank), busy = schedule_s - wait_s; "cpu_share" = CPU
    seconds over busy wall seconds. `ranks` are `_rank`'s results of one
    launch (each with "stage", "data" and "steps" of "wait_s", "schedule_s",
    "cpu_s"). Returns dicts with "stage", "data", "own", "span", "cpu_share"
    and "wait_s", "busy_s".
    Raises ValueError if a schedule_s is not positive (not a pipeline run)."""
    makespan: dict[int, float] = {}
    for r in ranks:
        makespan[r["data"]] = max(makespan.get(r["data"], 0.0), r["steps"][step]["schedule_s"])
    out = []
    for r in ranks:
        row = r["steps"][step]
        if row["schedule_s"] <= 0:
            raise ValueError(f"stage {r['stage']}: schedule_s={row['schedule_s']}; not a pipeline step")
        busy = row["schedule_s"] - row["wait_s"]
        out.append({"stage": r["stage"], "data": r["data"], "own": row["wait_s"] / row["schedule_s"],
                    "span": 1.0 - busy / makespan[r["data"]],
                    "cpu_share": row["cpu_s"] / busy if busy > 0 else float("nan"), "wait_s": row["wait_s"],
                    "busy_s": busy})
    return out


def theory_row(run: Run, micro_batches: int) -> dict:
    """The theory for `run` with `micro_batches` per pipeline: "paper"
    (`theoretical_bubble`, F = B = W), "sim own"/"sim span" (`simulate` of
    dsrun's schedules, F = B = W, read as the measurement reads a rank) and
    "sim step / 1f1b" (the simulated makespan over 1F1B's, same costs)."""
    from dsrun.runtime.parallel.pipe.schedule import build_schedule, theoretical_bubble
    from dsrun.runtime.parallel.pipe.simulate import simulate

    p, m, v = run.stages, micro_batches, run.virtual
    schedules = [build_schedule(run.schedule, p, r, m, v) for r in range(p)]

    res = simulate(schedules, 1.0 / v, 1.0 / v, 1.0 / v, virtual_stages=v)  # a chunk is 1/v of a stage
    own = statistics.mean((t.finish - t.busy) / t.finish for t in res.ranks)
    one_f_one_b = simulate([build_schedule("1f1b", p, r, m) for r in range(p)]).makespan
    return {"paper": theoretical_bubble(run.schedule, p, m, v), "sim own": own, "sim span": res.bubble_fraction,
            "sim step / 1f1b": res.makespan / one_f_one_b}


COMPUTE_KINDS = ("Forward", "Backward", "BackwardInput", "BackwardWeight")


def replay_costs(launches: list[list[dict]], stages: int) -> list[dict]:
    """Per stage, {action class: median CPU seconds of one such action} over
    every timed step of every launch and data replica (the rank results'
    "actions" tables, see [Note: per-action timing])."""
    from dsrun.runtime.parallel.pipe import schedule as sched

    samples: dict[tuple[int, str], list[float]] = {}
    for launch in launches:
        for rk in launch:
            for row in rk["steps"]:
                for kind in COMPUTE_KINDS:
                    if kind in row["actions"]:
                        t = row["actions"][kind]
                        samples.setdefault((rk["stage"], kind), []).append(t["cpu_s"] / t["count"])
    return [{getattr(sched, kind): statistics.median(samples[(st, kind)]) for kind in COMPUTE_KINDS
             if (st, kind) in samples} for st in range(stages)]


def replay_row(run: Run, micro_batches: int, costs: list[dict]) -> dict:
    """`simulate` of `run`'s schedules with the measured per-stage `costs`
    (replay_costs): "step" (the makespan, CPU s), "bubble" (idle over
    makespan, mean over ranks), "paper measured" (the paper's bubble with
    the measured passes, mean over stages: for zb-h1 F, BI, BW; the others'
    formulas do not depend on the costs), and "step on cores" (the makespan
    when the run's WORLD ranks share CORES cores, `simulate_on_cores`; the
    data replicas run the same schedules, so each pipeline gets
    CORES / data cores)."""
    from dsrun.runtime.parallel.pipe import schedule as sched
    from dsrun.runtime.parallel.pipe.simulate import simulate, simulate_on_cores

    p, m, v = run.stages, micro_batches, run.virtual
    schedules = [sched.build_schedule(run.schedule, p, r, m, v) for r in range(p)]
    res = simulate(schedules, virtual_stages=v, rank_costs=costs)
    mean = lambda kind: statistics.mean(c[kind] for c in costs) if all(kind in c for c in costs) else 1.0  # noqa: E731
    paper = sched.theoretical_bubble(run.schedule, p, m, v, mean(sched.Forward), mean(sched.BackwardInput),
                                     mean(sched.BackwardWeight)) if run.schedule == "zb-h1" else \
        sched.theoretical_bubble(run.schedule, p, m, v)
    return {"step": res.makespan, "bubble": res.bubble_fraction, "paper measured": paper,
            "step on cores": simulate_on_cores(schedules, costs, CORES * p / WORLD, v)}


def _mean_pass_ms(costs: list[dict], kind: str) -> str:
    """The mean over stages of one `kind` pass's CPU milliseconds, "-" where none ran."""
    values = [c[k] for c in costs for k in c if k.__name__ == kind]
    return f"{statistics.mean(values) * 1e3:.1f}" if values else "-"


def deepspeed_status() -> str:
    """Whether DeepSpeed itself (the `deepspeed` distribution, not dsrun's
    compatibility paths) is installed."""
    try:
        return f"DeepSpeed {importlib.metadata.version('deepspeed')} is installed but its PipelineEngine is not run " \
               f"by this script"
    except importlib.metadata.PackageNotFoundError:
        return "DeepSpeed is not installed here (no `deepspeed` distribution): no PipelineEngine column"


def _fmt_stages(values: dict[int, float], fmt: str) -> str:
    return " / ".join(format(values[k], fmt) for k in sorted(values))


def report(runs: list[Run], results: dict[str, list[list[dict]]], s: Shape, global_micro: int, args) -> None:
    """Print the tables (markdown) for `results[run.name]`: one list of rank
    results per launch."""
    times = {r.name: [max(rk["steps"][i]["step_s"] for rk in launch)
                      for launch in results[r.name] for i in range(len(launch[0]["steps"]))] for r in runs}
    base = statistics.median(times["dp"]) if "dp" in times else None
    total = sum(rk["params"] for rk in results[runs[0].name][0] if rk["data"] == 0)  # one model replica
    print(f"\nGPT {args.model} ({total / 1e6:.1f}M parameters, d={s.d}, {s.layers} blocks, vocab {s.vocab}, "
          f"seq {s.seq}, micro-batch {s.micro}), fp32, {WORLD} ranks x 1 thread, global batch {global_micro} "
          f"micro-batches; {args.repeats} interleaved repeats x {args.steps} timed steps after {args.warmup} "
          f"warm-up.\n{deepspeed_status()}.\n")
    print("| run | stages x data | m | min s/step | median s/step | spread | vs dp | CPU s/step, all ranks | peak RSS "
          "per stage, timed steps (MiB) | ru_maxrss per stage (MiB) | parameters per stage (M) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    per_stage = {}
    for r in runs:
        ts = times[r.name]
        med = statistics.median(ts)
        launches = results[r.name]
        hwm = {st: max(rk["hwm_mib"] for ln in launches for rk in ln if rk["stage"] == st) for st in range(r.stages)}
        maxrss = {st: max(rk["maxrss_mib"] for ln in launches for rk in ln if rk["stage"] == st)
                  for st in range(r.stages)}
        params = {st: next(rk["params"] for rk in launches[0] if rk["stage"] == st) / 1e6 for st in range(r.stages)}
        ratio = f"{med / base:.3f}" if base else "-"
        cpu = statistics.median(sum(rk["steps"][i]["cpu_s"] for rk in ln) for ln in launches
                                for i in range(len(ln[0]["steps"])))
        print(f"| {r.name} | {r.stages} x {r.data} | {global_micro // r.data} | {min(ts):.3f} | {med:.3f} | "
              f"{(max(ts) - min(ts)) / med:.1%} | {ratio} | {cpu:.2f} | {_fmt_stages(hwm, 'd')} | {_fmt_stages(maxrss, 'd')} | "
              f"{_fmt_stages(params, '.2f')} |")
        if r.stages > 1:
            samples: dict[tuple[int, int], dict[str, list[float]]] = {}
            for ln in launches:
                for i in range(len(ln[0]["steps"])):
                    for b in step_bubbles(ln, i):
                        d = samples.setdefault((b["stage"], b["data"]), {k: [] for k in BUBBLE_KEYS})
                        for k in BUBBLE_KEYS:
                            d[k].append(b[k])
            per_stage[r.name] = {
                st: {k: statistics.mean(statistics.median(v[k]) for (st2, _), v in samples.items() if st2 == st)
                     for k in BUBBLE_KEYS} for st in range(r.stages)}
    pipes = [r for r in runs if r.stages > 1]
    if not pipes:
        return
    print("\nBubble, mean over stages (measured: medians over timed steps; theory: paper = theoretical_bubble "
          "with F = B = W; sim = simulate() of dsrun's schedules with F = B = W; own = wait / own schedule, "
          "span = idle / pipeline makespan):\n")
    print("| run | m | measured own | measured span | paper | sim own | sim span | span / paper | own / sim own | "
          "step / 1f1b measured | step / 1f1b sim | CPU share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in pipes:
        m = global_micro // r.data
        th = theory_row(r, m)
        st = per_stage[r.name]
        own = statistics.mean(v["own"] for v in st.values())
        span = statistics.mean(v["span"] for v in st.values())
        cpu = statistics.mean(v["cpu_share"] for v in st.values())
        ref = f"p{r.stages}-1f1b"
        measured = f"{statistics.median(times[r.name]) / statistics.median(times[ref]):.3f}" if ref in times else "-"
        print(f"| {r.name} | {m} | {own:.3f} | {span:.3f} | {th['paper']:.3f} | {th['sim own']:.3f} | "
              f"{th['sim span']:.3f} | {span / th['paper']:.2f} | {own / th['sim own']:.2f} | {measured} | "
              f"{th['sim step / 1f1b']:.3f} | {cpu:.2f} |")
    print("\nReplay with a core per rank (simulate() of each run's schedules with the measured CPU seconds per "
          "action and stage; see the docstring):\n")
    print(f"| run | m | replayed step (CPU s) | replayed bubble | paper | replayed / paper | paper, measured passes "
          f"| replayed / it | step / 1f1b replayed | replayed step, {WORLD} ranks on {CORES} cores (s) | / 1f1b's | "
          "F / B / BI / BW ms per pass, mean over stages |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    costs = {r.name: replay_costs(results[r.name], r.stages) for r in pipes}
    replayed = {r.name: replay_row(r, global_micro // r.data, costs[r.name]) for r in pipes}
    for r in pipes:
        row, paper = replayed[r.name], theory_row(r, global_micro // r.data)["paper"]
        ref = replayed.get(f"p{r.stages}-1f1b")
        ratio = f"{row['step'] / ref['step']:.3f}" if ref else "-"
        on_cores = f"{row['step on cores'] / ref['step on cores']:.3f}" if ref else "-"
        passes = " / ".join(_mean_pass_ms(costs[r.name], kind) for kind in COMPUTE_KINDS)
        print(f"| {r.name} | {global_micro // r.data} | {row['step']:.3f} | {row['bubble']:.3f} | {paper:.3f} | "
              f"{row['bubble'] / paper:.2f} | {row['paper measured']:.3f} | "
              f"{row['bubble'] / row['paper measured']:.2f} | {ratio} | {row['step on cores']:.3f} | {on_cores} | "
              f"{passes} |")
    print("\nPer stage (stage 0 / 1 / ...): measured own, measured span, median wait_s and busy s (schedule_s - "
          "wait_s) per step, CPU share:\n")
    print("| run | own | span | wait s | busy s | CPU share |")
    print("|---|---|---|---|---|---|")
    for r in pipes:
        st = per_stage[r.name]
        print(f"| {r.name} | {_fmt_stages({k: v['own'] for k, v in st.items()}, '.3f')} | "
              f"{_fmt_stages({k: v['span'] for k, v in st.items()}, '.3f')} | "
              f"{_fmt_stages({k: v['wait_s'] for k, v in st.items()}, '.3f')} | "
              f"{_fmt_stages({k: v['busy_s'] for k, v in st.items()}, '.3f')} | "
              f"{_fmt_stages({k: v['cpu_share'] for k, v in st.items()}, '.2f')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bench", choices=sorted(MODELS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global_micro_batches", type=int, default=8)
    ap.add_argument("--virtual", type=int, default=2, help="chunks per rank of the interleaved schedule")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--torch_adam", action="store_true",
                    help='"torch_adam": true (torch.optim.AdamW) instead of dsrun\'s CPU Adam')
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    args = ap.parse_args()
    runs = [parse_run(n, args.virtual) for n in args.runs.split(",")]
    s, g = MODELS[args.model], args.global_micro_batches
    for r in runs:
        if g % r.data:
            raise SystemExit(f"--global_micro_batches {g} must be a multiple of {r.data} (data replicas of {r.name})")
        if r.stages > 1:
            theory_row(r, g // r.data)  # the schedule's own argument checks, before any launch
        if r.stages * r.virtual > s.layers:
            raise SystemExit(f"{r.name}: {r.stages * r.virtual} parts but only {s.layers} blocks")
    results: dict[str, list] = {r.name: [] for r in runs}
    load_before = os.getloadavg()[0]
    for rep in range(args.repeats):
        for r in runs:  # interleaved: A B C ..., A B C ...
            t0 = time.perf_counter()
            launch = run_ranks(_rank, WORLD, r, s, g, args.warmup, args.steps, args.torch_adam, timeout=args.timeout)
            results[r.name].append(launch)
            med = statistics.median(max(rk["steps"][i]["step_s"] for rk in launch) for i in range(args.steps))
            print(f"[repeat {rep + 1}/{args.repeats}] {r.name}: median {med:.3f} s/step "
                  f"(launch {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"\nload average (1 min) {load_before:.1f} before the launches, {os.getloadavg()[0]:.1f} after; "
          f"{os.cpu_count()} CPUs")
    report(runs, results, s, g, args)


if __name__ == "__main__":
    main()

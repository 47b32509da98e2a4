"""Step time of the 48M-parameter GPT of REFERENCE.md §6 under DDP, FSDP2 and
dsrun ZeRO stages 0-3, next to the compute floor, measured side by side in one run.

    .venv/bin/python bench/step_time/gpt_step.py [--repeats 3] [--warmup 2] [--steps 5]
        [--runs floor,ddp,fsdp2,dsrun-0,dsrun-1,dsrun-2,dsrun-3] [--model 48m|small] [--torch_adam]
    .venv/bin/python bench/step_time/gpt_step.py --paired floor,ddp,sync,thread,torch --repeats 12 [--model small]
    .venv/bin/python bench/step_time/gpt_step.py --paired floor,ddp,fsdp2,dsrun-0,dsrun-1,dsrun-2,dsrun-3 --repeats 12

Model: d=512, 10 layers, 8 heads, vocab 32000, seq 256, micro-batch 2, tied
embedding/head (48.0M parameters), fp32; `--model small` (d=256, 4 layers,
vocab 8000, seq 128, 5.2M parameters) is for quick loops. 2 ranks on one
machine, 1 torch thread each.

Configurations (every one runs AdamW, lr 1e-4, weight decay 0.01, in a fused
kernel of about the same cost -- 29-35 ms per step of the 48M model on one
thread here, against 260-300 ms for torch's default per-tensor loop, which
would hide a tenth of the step):
- floor: two replicas that never synchronise gradients (gloo is initialised
  only for the timing barriers): the compute alone, the physical floor of
  any data-parallel step. torch.optim.AdamW(fused=True).
- ddp: torch DistributedDataParallel over gloo (25 MB buckets, all-reduce
  overlapped with backward on gloo's thread). torch.optim.AdamW(fused=True).
- fsdp2: torch fully_shard per block and on the root, gloo.
  torch.optim.AdamW(fused=True).
- dsrun-N: dsrun.initialize with ZeRO stage N, reduce/allgather buckets of
  5e6 elements (20 MB fp32), the optimizer from ds_config ("AdamW"):
  dsrun's native CPU Adam, fused into the ZeRO step at stages 1-3;
  `--torch_adam` adds "torch_adam": true (torch.optim.AdamW(fused=True), the
  very kernel of the torch configurations). The world group's collectives
  go over shared memory (dsrun/runtime/comm/collectives.py, [Note: choosing
  the transport]).
A configuration may carry environment variables for its ranks after colons,
e.g. `dsrun-0:DSRUN_SHM_COMM=0` (gloo) or `dsrun-0:DSRUN_COMM_OVERLAP=sync`,
so that variants of one stage are compared side by side.

Each launch is a fresh pair of processes (so peak RSS is its own) running
`--warmup` untimed then `--steps` timed steps; a step is forward + backward +
optimizer step, timed between barriers, and counted as the slower rank's
time. Configurations are interleaved -- repeat 1 runs A B C ..., repeat 2
again A B C ... -- so a change in the machine's load (it is shared) hits
every configuration alike. Reported per configuration over all timed steps
of all repeats: minimum, median, spread ((max - min) / median), the ratio
of the median to DDP's and to the floor's, and each rank's peak RSS
(ru_maxrss, the largest over repeats).

`--paired` compares configurations more finely than separate launches can
on a shared machine: one pair of processes holds a plain replica
("floor"), a DDP copy ("ddp"), an FSDP2 copy ("fsdp2") and one dsrun engine
per ZeRO stage named ("dsrun-N"), and runs `--repeats` cycles of one step
of each, the order rotated every cycle. "dsrun-N:MODE" drives stage N's
overlapped collectives in DSRUN_COMM_OVERLAP mode MODE (default thread; see
[Note: overlap on a communication thread] in
dsrun/runtime/comm/collectives.py), so "dsrun-2:sync,dsrun-2" is stage 2
before and after its collectives moved to the communication thread;
"sync", "thread", "torch" alone are stage 0 in that mode. Reported: each
mode's median ratio to the DDP and floor steps of the same cycle (wall
and CPU), how often it beat DDP in the same cycle, the CPU seconds of all
threads of both ranks per step (a figure the machine's load moves far
less than wall time) and the load average before and after. All modes of
one process share its allocator: dsrun's policy (glibc's mmap threshold
fixed at 1 MiB and the caching host allocator, dsrun/runtime/memory/allocator.py)
is in effect for the floor, DDP and FSDP2 steps here too, so --paired
compares the collectives and the step's code, not the allocators.
Separate launches (--runs) give each configuration its own: the floor,
DDP and FSDP2 run with glibc's defaults, as their users do. --runs also
reports CPU seconds and minor page faults per step (both ranks), e.g.
`--runs ddp,dsrun-3,dsrun-3:DSRUN_HOST_CACHE_MB=0,dsrun-3:DSRUN_MALLOC=0`
(a configuration's variables are set before its ranks start).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import multiprocessing as mp
import os
import queue
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn
from torch.nn import functional as F

RUNS = ("floor", "ddp", "fsdp2", "dsrun-0", "dsrun-1", "dsrun-2", "dsrun-3")
LR, WEIGHT_DECAY = 1e-4, 0.01


@dataclasses.dataclass(frozen=True)
class Shape:
    d: int
    layers: int
    heads: int
    vocab: int
    seq: int
    micro: int
    bucket: int  # elements per dsrun reduce/allgather bucket


MODELS = {
    # 5e6 elements = 20 MB fp32 buckets, as DDP's 25 MB: several buckets overlap with backward.
    "48m": Shape(d=512, layers=10, heads=8, vocab=32000, seq=256, micro=2, bucket=5_000_000),
    "small": Shape(d=256, layers=4, heads=4, vocab=8000, seq=128, micro=2, bucket=1_000_000),
}


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.ln1, self.ln2 = nn.LayerNorm(s.d), nn.LayerNorm(s.d)
        self.qkv, self.proj = nn.Linear(s.d, 3 * s.d), nn.Linear(s.d, s.d)
        self.fc, self.out = nn.Linear(s.d, 4 * s.d), nn.Linear(4 * s.d, s.d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.s.heads, d // self.s.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.wte, self.wpe = nn.Embedding(s.vocab, s.d), nn.Embedding(s.seq, s.d)
        self.h = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.d)
        self.head = nn.Linear(s.d, s.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, self.s.vocab), targets.reshape(-1))


def _torch_adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def _torch_parallel(run: str, model: nn.Module) -> nn.Module:
    """`model` as configuration `run` trains it: "floor" as it is, "ddp" in
    DistributedDataParallel, "fsdp2" with fully_shard per block and on the
    root. Raises ValueError for another name."""
    if run == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if run == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        return fully_shard(model)
    if run != "floor":
        raise ValueError(f"unknown configuration {run!r}; known: {', '.join(RUNS)}")
    return model


def _dsrun_engine(model: nn.Module, s: Shape, stage: int, torch_adam: bool):
    import dsrun

    adamw = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
    if torch_adam:
        adamw["params"]["torch_adam"] = True
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(),
                                  config={"train_micro_batch_size_per_gpu": s.micro, "gradient_clipping": 0.0,
                                          "optimizer": adamw,
                                          "zero_optimization": {"stage": stage, "reduce_bucket_size": s.bucket,
                                                                "allgather_bucket_size": s.bucket},
                                          "steps_per_print": 10**9})
    return engine


def _rank_env(env: dict, rank: int, port: int) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(0)


def _rank(run: str, env: dict, s: Shape, torch_adam: bool, warmup: int, steps: int, rank: int, port: int,
          out: "mp.Queue") -> None:
    _rank_env(env, rank, port)
    import torch.distributed as dist

    model = GPT(s)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, s.vocab, (s.micro, s.seq + 1), generator=g) for _ in range(warmup + steps)]
    if run.startswith("dsrun"):
        engine = _dsrun_engine(model, s, int(run.split("-")[1]), torch_adam)

        def step(batch):
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
    else:
        dist.init_process_group("gloo")
        model = _torch_parallel(run, model)
        opt = _torch_adamw(model.parameters())

        def step(batch):
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()  # floor: the replicas' gradients stay their own
            opt.step()
            opt.zero_grad(set_to_none=True)
    times, cpu, faults = [], [], []
    for i, batch in enumerate(data):
        dist.barrier()
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        step(batch)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            faults.append(r1.ru_minflt - r0.ru_minflt)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put((rank, times, rss_mib, cpu, faults))
    dist.destroy_process_group()


OVERLAP = ("sync", "thread", "torch")  # DSRUN_COMM_OVERLAP values; alone in --paired: dsrun-0 with that mode
PAIRED = ("floor", "ddp", "fsdp2", *OVERLAP, "dsrun-0", "dsrun-1", "dsrun-2", "dsrun-3")


def paired_mode(mode: str) -> tuple[str, int | None, str | None]:
    """A --paired mode -> (kind, ZeRO stage, DSRUN_COMM_OVERLAP): "floor",
    "ddp", "fsdp2"; "sync"/"thread"/"torch" (dsrun stage 0 in that mode);
    "dsrun-N" (stage N, thread) or "dsrun-N:MODE"."""
    name, _, overlap = mode.partition(":")
    if name in OVERLAP and not overlap:
        return "dsrun", 0, name
    if name in ("floor", "ddp", "fsdp2") and not overlap:
        return name, None, None
    if name in RUNS[3:] and overlap in ("", *OVERLAP):
        return "dsrun", int(name.split("-")[1]), overlap or "thread"
    raise SystemExit(f"--paired: unknown mode {mode!r}; known: {', '.join(PAIRED)}, dsrun-N:{'|'.join(OVERLAP)}")


def _paired_rank(modes: list[str], s: Shape, torch_adam: bool, warmup: int, cycles: int, rank: int, port: int,
                 out: "mp.Queue") -> None:
    """One step per mode per cycle, the order rotated each cycle, on model
    copies that live side by side in this process (see `paired_mode`): a
    plain replica (no gradient exchange), a DDP copy, an FSDP2 copy and one
    dsrun engine per ZeRO stage named, each stage driven in the
    DSRUN_COMM_OVERLAP mode its names ask for. Puts
    (rank, {mode: [(wall s, CPU s of all this process's threads)]})."""
    _rank_env({}, rank, port)
    import torch.distributed as dist

    from dsrun.runtime.comm import collectives

    parsed = {m: paired_mode(m) for m in modes}
    engines = {}
    for stage in sorted({st for kind, st, _ in parsed.values() if kind == "dsrun"}):
        torch.manual_seed(0)
        engines[stage] = _dsrun_engine(GPT(s), s, stage, torch_adam)  # the first initialises the default group
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    replicas = {}
    for kind in ("floor", "ddp", "fsdp2"):
        if kind in modes:
            torch.manual_seed(0)
            model = _torch_parallel(kind, GPT(s))
            replicas[kind] = (model, _torch_adamw(model.parameters()))
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, s.vocab, (s.micro, s.seq + 1), generator=g)
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for c in range(warmup + cycles):
        for mode in modes[c % len(modes):] + modes[:c % len(modes)]:
            kind, stage, overlap = parsed[mode]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if kind in replicas:
                model, opt = replicas[kind]
                model(batch[:, :-1], batch[:, 1:]).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                # Every rank sets the same mode at the same step: what the ranks'
                # agreement at group creation (collectives.py) guarantees in a real job.
                collectives._WorldShm.overlap = overlap
                engine = engines[stage]
                engine.backward(engine(batch[:, :-1], batch[:, 1:]))
                engine.step()
            c1 = time.process_time()
            dist.barrier()
            if c >= warmup:
                results[mode].append((time.perf_counter() - t0, c1 - c0))
    out.put((rank, results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_run(spec: str) -> tuple[str, dict[str, str]]:
    """"dsrun-0:KEY=VAL:KEY2=VAL2" -> ("dsrun-0", {"KEY": "VAL", "KEY2": "VAL2"})."""
    name, *assignments = spec.split(":")
    if name not in RUNS:
        raise SystemExit(f"unknown configuration {name!r} in {spec!r}; known: {', '.join(RUNS)}")
    env = {}
    for a in assignments:
        key, sep, value = a.partition("=")
        if not sep or not key:
            raise SystemExit(f"{spec!r}: expected NAME:KEY=VALUE[:KEY=VALUE...]")
        env[key] = value
    return name, env


def _launch(name: str, target, *args) -> list:
    """Run target(*args, rank, port, out) on 2 ranks; their results in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(*args, r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{name}: a rank exited with code {dead[0]} (traceback above)")
    results.sort(key=lambda r: r[0])
    for p in procs:
        p.join()
    return results
def compare_configurations(specs: list[str], s: Shape, args) -> None:
    times: dict[str, list[float]] = {spec: [] for spec in specs}
    cpu: dict[str, list[float]] = {spec: [] for spec in specs}
    faults: dict[str, list[int]] = {spec: [] for spec in specs}
    rss: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for spec in specs:  # interleaved: A B C ... A B C ...
            run, env = parse_run(spec)
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # in the parent too, so the ranks start with it (glibc reads its variables then)
            try:
                results = _launch(spec, _rank, run, env, s, args.torch_adam, args.warmup, args.steps)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            t = [max(a, b) for a, b in zip(results[0][1], results[1][1])]  # the slower rank's step
            times[spec] += t
            cpu[spec] += [a + b for a, b in zip(results[0][3], results[1][3])]
            faults[spec] += [a + b for a, b in zip(results[0][4], results[1][4])]
            rss[spec] = [max(old, new[2]) for old, new in zip(rss.get(spec, [0.0, 0.0]), results)]
            print(f"[repeat {rep + 1}/{args.repeats}] {spec}: median {statistics.median(t):.3f} s/step "
                  f"(min {min(t):.3f})", file=sys.stderr, flush=True)

    def ratio(spec: str, base: str) -> str:
        if base not in times:
            return "-"
        return f"{statistics.median(times[spec]) / statistics.median(times[base]):.3f}"

    print(f"\n{_title(s, args)}; {args.repeats} interleaved repeat(s) x {args.steps} timed steps after "
          f"{args.warmup} warm-up\n")
    print("| run | min s/step | median s/step | spread | vs DDP | vs floor | CPU s/step, both ranks | CPU vs DDP | "
          "page faults/step, both ranks | peak RSS rank0/rank1 (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in specs:
        ts = times[spec]
        med = statistics.median(ts)
        cpu_ratio = (f"{statistics.median(cpu[spec]) / statistics.median(cpu['ddp']):.3f}" if "ddp" in cpu else "-")
        print(f"| {spec} | {min(ts):.3f} | {med:.3f} | {(max(ts) - min(ts)) / med:.1%} | "
              f"{ratio(spec, 'ddp')} | {ratio(spec, 'floor')} | {statistics.median(cpu[spec]):.3f} | {cpu_ratio} | "
              f"{statistics.median(faults[spec]):.0f} | {rss[spec][0]:.0f} / {rss[spec][1]:.0f} |")


def compare_paired(modes: list[str], s: Shape, args) -> None:
    load_before = os.getloadavg()
    results = _launch("paired", _paired_rank, modes, s, args.torch_adam, 1, args.repeats)
    load_after = os.getloadavg()
    wall = {m: [max(a[0], b[0]) for a, b in zip(results[0][1][m], results[1][1][m])] for m in modes}
    cpu = {m: [a[1] + b[1] for a, b in zip(results[0][1][m], results[1][1][m])] for m in modes}

    def per_cycle(a: str, b: str, of=wall) -> str:
        return f"{statistics.median(x / y for x, y in zip(of[a], of[b])):.3f}" if b in of else "-"

    def wins(a: str, b: str) -> str:
        return f"{sum(x < y for x, y in zip(wall[a], wall[b]))}/{args.repeats}" if b in wall and a != b else "-"

    print(f"\n{_title(s, args)}; {args.repeats} cycles of one step per mode (order rotated) after 1 "
          "warm-up cycle, in one pair of processes; sync/thread/torch: dsrun stage 0 with that "
          "DSRUN_COMM_OVERLAP, dsrun-N: stage N (thread unless :MODE)")
    print("load average (1/5/15 min) before " + "/".join(f"{x:.1f}" for x in load_before)
          + ", after " + "/".join(f"{x:.1f}" for x in load_after) + f" on {os.cpu_count()} CPUs\n")
    print("| mode | min s/step | median s/step | spread | vs DDP | vs floor | faster than DDP | "
          "CPU s/step, both ranks | CPU vs DDP | CPU vs floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in modes:
        med = statistics.median(wall[m])
        print(f"| {m} | {min(wall[m]):.3f} | {med:.3f} | {(max(wall[m]) - min(wall[m])) / med:.1%} | "
              f"{per_cycle(m, 'ddp')} | {per_cycle(m, 'floor')} | {wins(m, 'ddp')} | "
              f"{statistics.median(cpu[m]):.3f} | {per_cycle(m, 'ddp', cpu)} | {per_cycle(m, 'floor', cpu)} |")
    print("\n(vs DDP, vs floor: median over cycles of the ratio to that cycle's step, wall or CPU; "
          "CPU: median; faster than DDP: cycles in which the step beat DDP's)")
    if len(modes) <= 6:
        for a, b in itertools.combinations(modes, 2):
            print(f"{a} faster than {b} in {wins(a, b)} cycles; median per-cycle ratio "
                  f"{per_cycle(a, b)} (wall), {per_cycle(a, b, cpu)} (CPU)")


def _title(s: Shape, args) -> str:
    n_params = sum(p.numel() for p in GPT(s).parameters())
    adam = "torch fused everywhere" if args.torch_adam else "dsrun native, torch fused"
    return f"{n_params / 1e6:.1f}M GPT, 2 ranks x 1 thread, fp32, AdamW ({adam})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1,
                    help="launches of each configuration, interleaved (with --paired: cycles)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per launch")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per launch")
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="comma-separated configurations, each NAME[:KEY=VALUE...] (environment of its ranks)")
    ap.add_argument("--model", choices=sorted(MODELS), default="48m")
    ap.add_argument("--torch_adam", action="store_true",
                    help="dsrun configurations use torch.optim.AdamW(fused=True) instead of dsrun's native Adam")
    ap.add_argument("--paired", default=None,
                    help=f"instead of --runs: alternate these step by step in one pair of processes "
                         f"(any of {','.join(PAIRED)}, or dsrun-N:MODE with MODE one of {','.join(OVERLAP)})")
    args = ap.parse_args()
    s = MODELS[args.model]
    if args.paired:
        modes = args.paired.split(",")
        for mode in modes:
            paired_mode(mode)  # fail before launching
        compare_paired(modes, s, args)
        return
    specs = args.runs.split(",")
    for spec in specs:
        parse_run(spec)  # fail before the first launch
    compare_configurations(specs, s, args)


if __name__ == "__main__":
    main()

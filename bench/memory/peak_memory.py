"""Peak memory per rank under DDP, FSDP2 and dsrun ZeRO stages 0-3, against
the ZeRO model-state formulas: does ZeRO deliver its memory?

    .venv/bin/python bench/memory/peak_memory.py [--layers 48] [--width 2048] [--steps 3]
        [--repeats 1] [--precision fp32|bf16] [--runs ddp,fsdp2,...] [--deepspeed DIR]
        [--knobs small|default] [--profile]

Model: `layers` x nn.Linear(width, width) in an nn.ModuleList (default 48 x
2048: 201.4M parameters, Ψ), forward = the input through each layer, loss =
MSE to a fixed target; a micro-batch of 2 rows, so activations are
negligible and what a rank holds is its model states. Each configuration is
a fresh pair of rank processes (this file with --worker; gloo on CPU,
MASTER_ADDR 127.0.0.1, 1 torch thread each), launched in turn and
interleaved across repeats (A B C ... A B C). A rank initialises its process
group, then reads its RSS (VmRSS of /proc/self/status) and resets its peak
(writes 5 to /proc/self/clear_refs, so VmHWM restarts from the current
RSS); then it builds the model, wraps it, and runs `--steps` training steps
(forward, backward, AdamW step). Reported per rank, in MiB above that
baseline:
  peak         VmHWM after the steps (median [min-max] over repeats)
  after build  VmRSS right after the model was constructed (before
               wrapping): the whole model unless zero.Init partitioned it
and per configuration the model-state formula with Ψ trainable parameters
and N = 2 ranks, the ratio peak / formula (the larger rank's median), and,
for dsrun, `dsrun.estimate_zero_memory`'s prediction of its persistent
buffers (dsrun's own layout, with its bucket padding; where it differs from
the paper's formula, dsrun keeps buffers the paper does not count).

Configurations (--runs, default all but deepspeed-*):
  ddp               torch DistributedDataParallel, AdamW(fused=True)
  fsdp2             torch.distributed.fsdp.fully_shard per Linear, then the root; AdamW(fused=True)
  dsrun-0 .. dsrun-3    dsrun.initialize, zero_optimization.stage 0..3, optimizer AdamW
  dsrun-3-init      as dsrun-3, the model built inside `with dsrun.zero.Init():`
  deepspeed-0 .. deepspeed-3, deepspeed-3-init   the same with DeepSpeed, when --deepspeed DIR
                    names a directory holding the deepspeed package (e.g. from
                    `pip install --target DIR deepspeed --no-deps` plus its
                    pure-Python dependencies); DS_ACCELERATOR=cpu.

Formulas (bytes per rank; the paper's terms with this run's element sizes):
  fp32 (no separate master copy: params 4 + grads 4 + Adam 8 bytes)
    stage 0 16Ψ, stage 1 8Ψ+8Ψ/N, stage 2 4Ψ+12Ψ/N, stage 3 16Ψ/N
  bf16 (2-byte params, fp32 master + Adam 12 bytes, gradients in dsrun's
  data_types.grad_accum_dtype, fp32 by default: 4 bytes; the header says so)
    stage 0 18Ψ, stage 1 6Ψ+12Ψ/N, stage 2 2Ψ+16Ψ/N, stage 3 18Ψ/N
  ddp is stage 0's formula, fsdp2 and *-3-init stage 3's.
--precision bf16: dsrun and DeepSpeed get "bf16": {"enabled": true}. fsdp2
keeps fp32 sharded parameters (they are its master copy) and computes in
bf16 via MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), so its
formula stays 16Ψ/N. ddp is skipped: DDP has no bf16 parameters with an fp32
master copy (autocast would keep fp32 parameters, i.e. the fp32 run). Note
that DeepSpeed's ZeRO 1-3 keep bf16 gradients, 2 bytes, not the 4 assumed.

--knobs default gives dsrun and DeepSpeed no bucket or stage-3 knobs (their
defaults: reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7,
stage3_max_live_parameters and stage3_max_reuse_distance 1e9), as a new
user's config; the default, small, sets those below. --profile has dsrun's
rank 0 measure each phase of every step (engine.enable_memory_profile) and
prints its table of every step (dsrun.runtime.memory.profile): where the
peak's bytes are, per phase and per category.

A guard polls both ranks' RSS and stops a launch whose sum passes
--rss-limit-gib (default 10), so a run cannot exhaust a shared machine; the
row then says so. Ratios near 1 mean ZeRO delivers its memory; the excess
is buffers the formula does not count (communication buckets, gathered
parameters, allocator slack, temporary copies).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

WORLD = 2  # ranks per launch: N in the formulas
MICRO = 2  # rows per micro-batch
LR = 1e-4

# Bucket and stage-3 knobs given to dsrun and DeepSpeed (elements), printed in the header;
# the same as tests/zero/test_peak_memory.py. They bound the working set beyond the model
# states: two reduce buckets in flight, at most max_live gathered parameters.
ZERO_KNOBS = {"reduce_bucket_size": 1e7, "allgather_bucket_size": 1e7}
STAGE3_KNOBS = {"stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5,
                "stage3_max_live_parameters": 2e7}

RUNS = ("ddp", "fsdp2", "dsrun-0", "dsrun-1", "dsrun-2", "dsrun-3", "dsrun-3-init")
DS_RUNS = ("deepspeed-0", "deepspeed-1", "deepspeed-2", "deepspeed-3", "deepspeed-3-init")

MIB = 2 ** 20
GRAD_BYTES = 4  # dsrun's default data_types.grad_accum_dtype is fp32


class Stack(nn.Module):
    """`layers` x Linear(width, width); forward(x, y) = MSE(layers(x), y)."""

    def __init__(self, layers: int, width: int):
        """Build the layers (default nn.Linear initialisation)."""
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Pass x through every layer (cast to the weights' dtype) and return the fp32 MSE to y."""
        for layer in self.layers:
            x = layer(x.to(layer.weight.dtype))
        return F.mse_loss(x.float(), y)


def ds_config(stage: int, precision: str, knobs: str = "small") -> dict:
    """The dsrun/DeepSpeed config of one stage: AdamW, the knobs above ("small") or none
    ("default": the libraries' defaults), bf16 when asked."""
    zero = {"stage": stage}
    if knobs == "small":
        zero.update(ZERO_KNOBS, **(STAGE3_KNOBS if stage == 3 else {}))
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": zero}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def parse_run(run: str) -> tuple[str, int, bool]:
    """'dsrun-3-init' -> ('dsrun', 3, True); 'ddp' -> ('ddp', 0, False); 'fsdp2' -> ('fsdp2', 3, False)."""
    if run in ("ddp", "fsdp2"):
        return run, 0 if run == "ddp" else 3, False
    m = re.fullmatch(r"(dsrun|deepspeed)-([0-3])(-init)?", run)
    if not m or (m.group(3) and m.group(2) != "3"):
        raise ValueError(f"unknown run {run!r}; choose from {', '.join(RUNS + DS_RUNS)}")
    return m.group(1), int(m.group(2)), bool(m.group(3))


def num_params(layers: int, width: int) -> int:
    """Ψ: trainable parameters of Stack(layers, width)."""
    return layers * (width * width + width)


def formula(stage: int, param_bytes: int, grad_bytes: int, opt_bytes: int) -> tuple[str, float]:
    """The paper's model-state bytes per rank of a ZeRO stage: (text, bytes per Ψ).

    param_bytes/grad_bytes: element sizes; opt_bytes: optimizer bytes per
    parameter (fp32 master if any + Adam's two moments).
    """
    p, g, k, n = param_bytes, grad_bytes, opt_bytes, WORLD
    return [(f"{p + g + k}Ψ", p + g + k),
            (f"{p + g}Ψ+{k}Ψ/N", p + g + k / n),
            (f"{p}Ψ+{g + k}Ψ/N", p + (g + k) / n),
            (f"{p + g + k}Ψ/N", (p + g + k) / n)][stage]


def run_formula(run: str, precision: str) -> tuple[str, float]:
    """The formula a configuration is held to (see the module docstring)."""
    fw, stage, _ = parse_run(run)
    if precision == "fp32" or fw == "fsdp2":  # fsdp2's fp32 shards are its master copy
        return formula(stage, 4, 4, 8)
    return formula(stage, 2, GRAD_BYTES, 12)


def status_kib(field: str, pid: str = "self") -> int:
    """A field of /proc/PID/status (VmRSS, VmHWM) in KiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def mem_total_gib() -> float:
    """MemTotal of /proc/meminfo in GiB."""
    kib = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M).group(1)
    return int(kib) / 2 ** 20


# ---------------------------------------------------------------- rank worker


def worker(args: argparse.Namespace) -> None:
    """One rank of one configuration: baseline, build, wrap, train; print a RESULT line."""
    torch.set_num_threads(1)
    fw, stage, zero_init = parse_run(args.worker)
    rank = int(os.environ["RANK"])
    import torch.distributed as dist

    if fw == "deepspeed":
        sys.path.insert(0, args.deepspeed)
        import deepspeed as lib
        lib.init_distributed(dist_backend="gloo")
    elif fw == "dsrun":
        import dsrun as lib
        lib.init_distributed()
    else:
        dist.init_process_group("gloo")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    cfg = ds_config(stage, args.precision, args.knobs)
    profiling = args.profile and fw == "dsrun" and rank == 0
    phase_peak = 0  # with profiling: the largest VmHWM before a phase reset it (KiB)
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = torch.randn(MICRO, args.width, generator=g), torch.randn(MICRO, args.width, generator=g)
    dist.barrier()

    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    torch.manual_seed(0)
    if zero_init:
        with lib.zero.Init(config_dict_or_path=cfg):  # DeepSpeed takes the parameter dtype from it
            model = Stack(args.layers, args.width)
    else:
        model = Stack(args.layers, args.width)
    after_build = status_kib("VmRSS")

    if fw in ("dsrun", "deepspeed"):
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        if profiling:
            phase_peak = status_kib("VmHWM")
            engine.enable_memory_profile()

        def step() -> float:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()
    else:
        if fw == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if args.precision == "bf16" else MixedPrecisionPolicy()
            for layer in model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

        def step() -> float:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    losses, profiles = [], []
    for _ in range(args.steps):
        losses.append(step())
        if profiling:  # each phase resets VmHWM: the run's peak is the largest phase peak
            from dsrun.runtime.memory.profile import format_memory_profile
            prof = engine.memory_profile()
            profiles.append(format_memory_profile(prof))
            phase_peak = max([phase_peak] + [r["rss_peak"] // 1024 for r in prof["phases"].values()])
    peak = max(status_kib("VmHWM"), phase_peak)
    profile = "\n".join(profiles) or None
    dist.barrier()
    print("RESULT " + json.dumps({"rank": rank, "before_kib": before, "after_build_kib": after_build,
                                  "peak_kib": peak, "losses": losses, "profile": profile}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- launcher


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def echo_progress(log, offset: int) -> int:
    """Print the complete "PROGRESS " lines of `log` past byte `offset` to stderr; return the new offset."""
    log.seek(offset)
    data = log.read()
    done = data[:data.rfind(b"\n") + 1]
    for line in done.decode(errors="replace").splitlines():
        if line.startswith("PROGRESS "):
            print(line[len("PROGRESS "):], file=sys.stderr, flush=True)
    return offset + len(done)


def launch(script: Path, run: str, worker_args: list[str], deepspeed: str | None,
           rss_limit_gib: float, progress: bool = False) -> list[dict] | str:
    """Start WORLD fresh ranks of `script --worker run`, wait, return their RESULT dicts by rank.

    progress: echo rank 0's lines that start with "PROGRESS " to stderr as
    they come.

    When a rank exits with an error, or the ranks' RSS together passes
    rss_limit_gib, every rank is killed (a lone rank would wait in a
    collective). The launch still counts if every rank had printed its
    result (a crash while tearing down); otherwise a one-line reason is
    returned. The output tail of a rank that failed goes to stderr.
    """
    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), LOCAL_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        if run.startswith("deepspeed"):
            env["DS_ACCELERATOR"] = "cpu"
        log = tempfile.TemporaryFile()
        cmd = [sys.executable, str(script), "--worker", run, *worker_args]
        if deepspeed:
            cmd += ["--deepspeed", deepspeed]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    over_limit, echoed = False, 0
    while any(p.poll() is None for p in procs):
        if progress:
            echoed = echo_progress(logs[0], echoed)
        rss = 0
        for p in procs:
            try:
                rss += status_kib("VmRSS", str(p.pid)) * 1024
            except (FileNotFoundError, AttributeError):
                pass  # exited, or a zombie without VmRSS
        over_limit = rss > rss_limit_gib * 2 ** 30
        if over_limit or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            break
        time.sleep(0.1)
    codes = [p.wait() for p in procs]
    if progress:
        echo_progress(logs[0], echoed)
    results, missing = [], []
    for rank, (code, log) in enumerate(zip(codes, logs)):
        log.seek(0)
        text = log.read().decode(errors="replace")
        log.close()
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if lines:
            results.append(json.loads(lines[-1][len("RESULT "):]))
        else:
            missing.append(f"rank {rank} exit {code}")
        if code not in (0, -9):  # -9: killed here
            tail = "\n".join(text.splitlines()[-25:])
            print(f"--- {run} rank {rank} exited with code {code}; last lines:\n{tail}", file=sys.stderr)
    if not missing:
        return results
    return f"stopped: ranks' RSS passed {rss_limit_gib:g} GiB" if over_limit else "no result (" + ", ".join(missing) + ")"


def spread(samples: list[float]) -> str:
    """'median [min-max]' in whole MiB (just the value for one sample)."""
    med = statistics.median(samples)
    return f"{med:.0f}" if len(samples) == 1 else f"{med:.0f} [{min(samples):.0f}-{max(samples):.0f}]"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    head = line(header)
    return "\n".join([head, "-" * len(head), *map(line, rows)])


def dsrun_estimate_mib(stage: int, precision: str, layers: int, width: int, knobs: str) -> float:
    """dsrun.estimate_zero_memory's persistent bytes per rank (MiB), from a meta-device model."""
    from dsrun import estimate_zero_memory
    from dsrun.runtime.config import ZeroConfig

    with torch.device("meta"):
        model = Stack(layers, width)
    bucket = ds_config(stage, precision, knobs)["zero_optimization"].get("reduce_bucket_size",
                                                                       ZeroConfig().reduce_bucket_size)
    est = estimate_zero_memory(model, WORLD, stage, dtype=precision, bucket_numel=int(bucket))
    return est.total / MIB


def main() -> None:
    """Parse options; launch every configuration in turn per repeat; print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="training steps per launch")
    ap.add_argument("--repeats", type=int, default=1, help="launches of each configuration, interleaved")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--runs", help=f"comma-separated subset of {','.join(RUNS + DS_RUNS)}")
    ap.add_argument("--deepspeed", metavar="DIR", help="a directory holding the deepspeed package: "
                    "adds the deepspeed-* configurations, importing deepspeed from DIR")
    ap.add_argument("--knobs", choices=("small", "default"), default="small",
                    help="small: the bucket and stage-3 knobs above (default); default: none given")
    ap.add_argument("--profile", action="store_true",
                    help="print dsrun rank 0's memory profile per phase of every step")
    ap.add_argument("--rss-limit-gib", type=float, default=10.0,
                    help="stop a launch whose ranks together pass this RSS (default 10)")
    ap.add_argument("--worker", metavar="RUN", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    runs = args.runs.split(",") if args.runs else list(RUNS) + (list(DS_RUNS) if args.deepspeed else [])
    for run in runs:
        parse_run(run)
    if any(r.startswith("deepspeed") for r in runs) and not args.deepspeed:
        ap.error("deepspeed-* runs need --deepspeed DIR")
    if args.precision == "bf16" and "ddp" in runs:
        runs.remove("ddp")
        print("ddp skipped under --precision bf16 (see --help)", file=sys.stderr)
    worker_args = ["--layers", str(args.layers), "--width", str(args.width), "--steps", str(args.steps),
                   "--precision", args.precision, "--knobs", args.knobs] + (["--profile"] if args.profile else [])
    psi = num_params(args.layers, args.width)
    results: dict[str, list] = {run: [] for run in runs}
    for rep in range(args.repeats):
        for run in runs:
            t0 = time.perf_counter()
            out = launch(Path(__file__).resolve(), run, worker_args, args.deepspeed, args.rss_limit_gib)
            results[run].append(out)
            note = out if isinstance(out, str) else "peak " + " / ".join(
                f"{(r['peak_kib'] - r['before_kib']) / 1024:.0f}" for r in out) + " MiB"
            print(f"[{rep + 1}/{args.repeats}] {run}: {note} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)

    print(f"\nPeak RSS per rank above the RSS before the model was built; {WORLD} ranks x 1 thread, gloo, CPU")
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {psi / 1e6:.1f}M parameters (Ψ), "
          f"{args.precision}, AdamW, micro-batch {MICRO}, {args.steps} steps, {args.repeats} repeat(s)")
    print(f"machine: {os.cpu_count()} cores, {mem_total_gib():.1f} GiB RAM, {platform.machine()}, Python {platform.python_version()}, "
          f"torch {torch.__version__}" + (f", deepspeed from {args.deepspeed}" if args.deepspeed else ""))
    if args.knobs == "small":
        print(f"dsrun/DeepSpeed zero_optimization: {ZERO_KNOBS}; stage 3 also {STAGE3_KNOBS}")
    else:
        print("dsrun/DeepSpeed zero_optimization: no knobs given (the libraries' defaults)")
    print(f"example config (stage 3): {json.dumps(ds_config(3, args.precision, args.knobs))}")
    if args.precision == "bf16":
        print(f"bf16 formulas assume 2-byte params, {GRAD_BYTES}-byte gradients (dsrun's grad_accum_dtype "
              f"default, fp32), 12 bytes fp32 master + Adam")
    print()
    header = ["run", "peak r0 MiB", "peak r1 MiB", "formula", "formula MiB", "peak/formula",
              "dsrun est. MiB", "after build r0/r1 MiB"]
    rows, notes = [], []
    for run in runs:
        text, per_psi = run_formula(run, args.precision)
        form_mib = per_psi * psi / MIB
        fw, stage, _ = parse_run(run)
        est = f"{dsrun_estimate_mib(stage, args.precision, args.layers, args.width, args.knobs):.0f}" if fw == "dsrun" else "-"
        good = [r for r in results[run] if not isinstance(r, str)]
        failed = [r for r in results[run] if isinstance(r, str)]
        if not good:
            rows.append([run, "-", "-", text, f"{form_mib:.0f}", "-", est, "-"])
            notes.append(f"{run}: {failed[0]}")
            continue
        peaks = [[(r[k]["peak_kib"] - r[k]["before_kib"]) / 1024 for r in good] for k in range(WORLD)]
        builds = [statistics.median((r[k]["after_build_kib"] - r[k]["before_kib"]) / 1024 for r in good)
                  for k in range(WORLD)]
        ratio = max(statistics.median(p) for p in peaks) / form_mib
        notes += [f"{run}: {reason}" for reason in failed]
        rows.append([run + (f" ({len(failed)} failed)" if failed else ""), spread(peaks[0]), spread(peaks[1]),
                     text, f"{form_mib:.0f}", f"{ratio:.2f}", est, " / ".join(f"{b:.0f}" for b in builds)])
    print(format_table(header, rows))
    for note in notes:
        print(f"  {note}")
    for run in runs:
        last = [r for r in results[run] if not isinstance(r, str)]
        if last and last[-1][0].get("profile"):
            print(f"\n{run}, rank 0 (last repeat):\n{last[-1][0]['profile']}")
    print(f"\nN = {WORLD}; peak/formula uses the larger rank's median; MiB = 2^20 bytes; "
          "'dsrun est.' = dsrun.estimate_zero_memory (persistent buffers, with bucket padding)")


if __name__ == "__main__":
    main()

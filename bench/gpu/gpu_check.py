"""`make gpu-check`: dsrun on one GPU as one table, beside plain PyTorch.

    python bench/gpu/gpu_check.py --suite item5 --models 1.2b,82m --repeats 2 [--wheels gpu-wheels] [--out T.md]
    python bench/gpu/gpu_check.py [--models 82m,1.2b] [--out bench/gpu/last_run.md]    # --suite all
    python bench/gpu/gpu_check.py --device cpu --models tiny     # a smoke test without a GPU
    python bench/gpu/gpu_check.py --suite item5 --device cpu --models large=tiny,small=tiny --steps 2 --warmup 1

Suites (`--suite`); each model runs its role's rows: 1.2b the "large" ones,
any other the "small" ones, or the role given as ROLE=MODEL:
- item5 (issue 38 item 5; `make gpu-check`): large: plain PyTorch, stage 3
  with the default stage3_prefetch_bucket_size (5e7 elements) and with
  LARGE_PREFETCH ([Note: the large prefetch window]), stage 2 +
  offload_optimizer cpu (with its timeline); small: the one-stage
  PipelineEngine under 1f1b and zb-h1 (pipeline_check.py --run), and ZeRO 0
  and 2 of the GPT and of the same GPT with 4-expert MoE layers in
  alternate blocks (gpt_case.py --moe_experts 4, ep 1, top-1). A row's
  ratio divides its median step by its baseline's of the same model and
  repeat (stage 3: plain PyTorch; zb-h1: 1f1b; a MoE row: the GPT at its
  stage) or by a figure of FIGURES (ZeRO-Offload: DeepSpeed's 668.5 ms,
  measured elsewhere, footnoted so). `--repeats 2` runs the whole list
  twice, in order (A B C ... A B C ...).
- all: every configuration a user reaches, as below.

Each configuration runs in its own process (bench/gpu/gpt_case.py), so its
peak memory is its own and a crash fails only its row: plain PyTorch, ZeRO
stages 0-3 in bf16, stages 2-3 in fp16, zero.Init, activation
checkpointing, offload_optimizer cpu/nvme, offload_param cpu/nvme, and a
checkpoint round trip at stages 2 and 3 (resumed losses bit-equal). With
DeepSpeed installed, its stage 0/3 and ZeRO-Offload rows are added. The
ZeRO-Offload rows run with gpt_case.py's --timeline: their offload
timelines (copies, host gradient work, CPU Adam of the last step) and
initialize's time and peak are printed after the table. Then the checks of
bench/gpu/*_check.py run (each a script that exits non-zero on failure).

`--wheels DIR` first installs dsrun's run-time packages from DIR (made by
`make gpu-wheels`; bench/gpu/wheels.py) into build/gpu-site, for a machine
that has torch but not pydantic or paramiko; this checkout's dsrun is
imported first either way (it need not be installed). The native ops are
built first, in parallel (TORCH_CUDA_ARCH_LIST is set to the present GPU's
unless given; the seconds they took are printed). `--budget_s S` starts no
row after S seconds and cuts a running one there (it then fails);
`--logs DIR` keeps each row's whole output. Printed: per configuration the median and
minimum step time (ms), peak device memory (MiB, torch.cuda.max_memory_allocated),
first and last loss and the first loss's distance from plain PyTorch's (same
weights, same batch; bf16 weights move it by about 1e-3). A row fails when
its process fails, a loss is not finite, its first loss is more than 0.05
from its reference's (the first row of the same model and architecture:
plain PyTorch for the GPT, the first MoE or pipeline row for those), or a
resume differs; the exit status is non-zero when any row fails or was
skipped for the budget.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import wheels

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FIRST_LOSS_TOLERANCE = 0.05  # nats; bf16 weights against fp32 ones move the first loss by ~1e-3


class Case(NamedTuple):
    """One row: bench/gpu/`script` run with `argv` (and --model, --device,
    --steps, --warmup). vs: the label of the row of the same model and
    repeat whose median step this row's is divided by, or a key of FIGURES;
    goal: the ratio the issue asks for at most (reported, not a failure)."""
    label: str
    argv: list[str]
    vs: str | None = None
    script: str = "gpt_case.py"
    goal: float | None = None


# Figures from elsewhere that a row of one model is compared with: key -> (ms, model, where it comes from).
FIGURES = {"DeepSpeed's 668.5 ms": (668.5, "1.2b", "DeepSpeed 0.19.8's stage 2 + offload_optimizer cpu step on "
                                                   "this 1.2B GPT, REFERENCE.md section 7: measured on an H100 in "
                                                   "another session, not in this run")}
# [Note: the large prefetch window] A block of the 1.2B GPT holds 50,358,272
# elements in four stage-3 units (qkv 12.6M, attention projection 4.2M, MLP
# 16.8M + 16.8M; the LayerNorms are persistent), so the default window of
# 5e7 elements reaches the next three units, just short of one block ahead.
# 2.1e8 reaches four whole blocks (201.4M): gathers are issued a block or
# more before their use, and at the forward/backward turn the last four
# blocks stay gathered for the backward (a reuse within the window). It
# costs at most 2.1e8 more bf16 elements gathered (400 MiB; the peak is
# about 27 GiB).
LARGE_PREFETCH = "210000000"

SUITES = {
    "item5": {
        "large": [
            Case("plain PyTorch", ["--run", "plain"]),
            Case("stage 3", ["--stage", "3"], vs="plain PyTorch", goal=1.05),
            Case("stage 3, stage3_prefetch_bucket_size 2.1e8", ["--stage", "3", "--prefetch_bucket", LARGE_PREFETCH],
                 vs="plain PyTorch", goal=1.05),
            Case("stage 2 offload_optimizer cpu", ["--stage", "2", "--offload_optimizer", "cpu", "--timeline"],
                 vs="DeepSpeed's 668.5 ms", goal=1.0),
        ],
        "small": [
            Case("pipeline 1f1b", ["--run", "1f1b"], script="pipeline_check.py"),
            Case("pipeline zb-h1", ["--run", "zb-h1"], vs="pipeline 1f1b", script="pipeline_check.py", goal=1.0),
            Case("stage 0", ["--stage", "0"]),
            Case("stage 0 MoE 4 experts ep 1", ["--stage", "0", "--moe_experts", "4"], vs="stage 0"),
            Case("stage 2", ["--stage", "2"]),
            Case("stage 2 MoE 4 experts ep 1", ["--stage", "2", "--moe_experts", "4"], vs="stage 2"),
        ],
    },
    "all": {
        "small": [
            Case("plain PyTorch", ["--run", "plain"]),
            Case("stage 0", ["--stage", "0"]),
            Case("stage 1", ["--stage", "1"]),
            Case("stage 2", ["--stage", "2"]),
            Case("stage 3", ["--stage", "3"]),
            Case("stage 2 fp16", ["--stage", "2", "--fp16"]),
            Case("stage 3 fp16", ["--stage", "3", "--fp16"]),
            Case("stage 3 zero.Init", ["--stage", "3", "--zero_init"]),
            Case("stage 3 activation checkpointing", ["--stage", "3", "--act_ckpt"]),
            Case("stage 2 offload_optimizer cpu", ["--stage", "2", "--offload_optimizer", "cpu", "--timeline"]),
            Case("stage 3 offload_optimizer nvme", ["--stage", "3", "--offload_optimizer", "nvme"]),
            Case("stage 3 offload_param cpu", ["--stage", "3", "--offload_param", "cpu"]),
            Case("stage 3 offload_param nvme",
                 ["--stage", "3", "--offload_param", "nvme", "--offload_optimizer", "nvme"]),
            Case("stage 2 checkpoint resume", ["--stage", "2", "--resume"]),
            Case("stage 3 checkpoint resume", ["--stage", "3", "--resume"]),
        ],
        "large": [
            Case("plain PyTorch", ["--run", "plain"]),
            Case("stage 0", ["--stage", "0"]),
            Case("stage 3", ["--stage", "3"]),
            Case("stage 3 zero.Init", ["--stage", "3", "--zero_init"]),
            Case("stage 2 offload_optimizer cpu", ["--stage", "2", "--offload_optimizer", "cpu", "--timeline"]),
            Case("stage 3 offload_param cpu", ["--stage", "3", "--offload_param", "cpu", "--offload_optimizer", "cpu"]),
        ],
    },
}
DEEPSPEED_CASES = [
    Case("DeepSpeed stage 0", ["--run", "deepspeed", "--stage", "0"]),
    Case("DeepSpeed stage 3", ["--run", "deepspeed", "--stage", "3"]),
    Case("DeepSpeed stage 2 offload_optimizer cpu",
         ["--run", "deepspeed", "--stage", "2", "--offload_optimizer", "cpu"]),
]


def prebuild_ops(device: str, timeout: float) -> str:
    """Build every native op this machine supports, one process per op, in
    parallel; one line per op: loaded, the reason it did not build, or that
    it was still building after `timeout` seconds (then its build is killed
    and the rows build it again, or fall back, when they need it)."""
    from dsrun.ops.builder import OPS
    names = [n for n, spec in OPS.items() if device == "cuda" or not spec.requires_cuda]
    code = ("import sys; from dsrun.ops.builder import get_op; op = get_op(sys.argv[1]); op.load(); "
            "print(sys.argv[1], op.reason or 'loaded')")
    procs = [subprocess.Popen([sys.executable, "-c", code, n], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=ROOT, start_new_session=True) for n in names]
    deadline, lines = time.monotonic() + timeout, []
    for name, proc in zip(names, procs):
        try:
            lines.append((proc.communicate(timeout=max(deadline - time.monotonic(), 0))[0].strip().splitlines()
                          or [f"{name}: no output, exit {proc.returncode}"])[-1])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the compiler processes too
            proc.communicate()
            lines.append(f"{name} still building after {timeout:.0f} s (killed)")
    return "\n".join(lines)


def run_case(case: Case, model: str, argv: list[str], device: str, timeout: float, log: Path | None) -> dict:
    """Run one configuration; its RESULT line as a dict plus label, wall time
    and status. `log`: where to write the process's whole output (None: nowhere)."""
    cmd = [sys.executable, str(HERE / case.script), "--model", model, "--device", device, *case.argv, *argv]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = [v.decode(errors="replace") if isinstance(v, bytes) else (v or "") for v in (e.stdout, e.stderr)]
        out, rc = f"{text[0]}{text[1]}\ntimed out after {timeout:.0f} s", -1
    if log is not None:
        log.write_text(shlex.join(cmd) + "\n\n" + out)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT "):]) if lines else {}
    result.update(label=case.label, model=model, vs=case.vs, goal=case.goal, rc=rc, wall_s=time.perf_counter() - t0)
    if rc != 0:
        result["error"] = "\n".join(out.strip().splitlines()[-12:])
    return result


def judge(rows: list[dict]) -> None:
    """Set each row's `ok`, `note` and `ratio` (see the module docstring for the rules)."""
    reference: dict[tuple, float] = {}  # (model, arch) -> the first row's first loss
    for r in rows:
        if r.get("losses"):
            reference.setdefault((r["model"], r.get("arch", "gpt")), r["losses"][0])
    for r in rows:
        notes = []
        if r["rc"] != 0:
            notes.append("failed: " + r.get("error", "").splitlines()[-1][:160] if r.get("error") else "failed")
        losses = r.get("losses", [])
        if losses and not all(math.isfinite(v) for v in losses):
            notes.append("non-finite loss")
        ref = reference.get((r["model"], r.get("arch", "gpt")))
        if losses and ref is not None:
            r["d_first"] = abs(losses[0] - ref)
            if r["d_first"] > FIRST_LOSS_TOLERANCE:
                notes.append(f"first loss {losses[0]:.4f} vs reference {ref:.4f}")
        if r.get("resume_equal") is False:
            notes.append("resumed losses differ")
        r["ok"], r["note"] = not notes, "; ".join(notes)
        figure = FIGURES.get(r["vs"])
        base = (figure[0] if figure[1] == r["model"] else None) if figure else next(
            (b.get("step_ms_median") for b in rows if b["label"] == r["vs"] and b["model"] == r["model"]
             and b["repeat"] == r["repeat"]), None)
        if base and "step_ms_median" in r:
            r["ratio"] = r["step_ms_median"] / base


def table(rows: list[dict]) -> str:
    head = ("| model | run | configuration | step ms median (min) | ratio (baseline) | peak MiB | "
            "loss first -> last | \u0394 first vs reference | result |\n|---|---|---|---|---|---|---|---|---|")
    out = [head]
    for r in rows:
        ms = f"{r['step_ms_median']:.1f} ({r['step_ms_min']:.1f})" if "step_ms_median" in r else "-"
        ratio = "-" if "ratio" not in r else f"{r['ratio']:.2f}x ({r['vs']}{'*' if r['vs'] in FIGURES else ''}" + (
            f"; goal <= {r['goal']:.2f}: {'met' if r['ratio'] <= r['goal'] else 'not met'})" if r["goal"] else ")")
        peak = f"{r['peak_mib']:,.0f}" if "peak_mib" in r else "-"
        losses = r.get("losses")
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else (
            "resume equal" if r.get("resume_equal") else "-")
        d = f"{r['d_first']:.4f}" if "d_first" in r else "-"
        out.append(f"| {r['model']} | {r['repeat']} | {r['label']} | {ms} | {ratio} | {peak} | {loss} | {d} | "
                   f"{'ok' if r['ok'] else 'FAIL: ' + r['note']} |")
    out += [f"\n\\* {key}: {where}." for key, (_, _, where) in FIGURES.items()
            if any(r["vs"] == key and "ratio" in r for r in rows)]
    return "\n".join(out)


def timelines(rows: list[dict]) -> str:
    """The offload timelines of the rows run with --timeline, as indented text ('' when none)."""
    from dsrun.runtime.offload.transfer import format_timeline

    out = []
    for r in rows:
        if "build_s" in r:
            chart = format_timeline(r.get("timeline") or {}) or "no offload timeline (nothing offloaded)"
            out.append(f"{r['model']} run {r['repeat']} {r['label']}: initialize {r['build_s']:.1f} s, peak "
                       f"{r['build_peak_mib']:,.0f} MiB by then\n\n    " + chart.replace("\n", "\n    "))
    return "".join("\n\n" + t for t in out)


def extra_checks(device: str, timeout: float, skip: set[str]) -> list[tuple[str, int, str]]:
    """Run bench/gpu/*_check.py (other than this file and those in `skip`):
    (name, exit status, last lines)."""
    results = []
    for script in sorted(HERE.glob("*_check.py")):
        if script.name == Path(__file__).name or script.name in skip:
            continue
        try:
            proc = subprocess.run([sys.executable, str(script), "--device", device], capture_output=True,
                                  text=True, timeout=timeout, cwd=ROOT)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            rc, out = -1, f"timed out after {timeout:.0f} s"
        results.append((script.name, rc, "\n".join(out.strip().splitlines()[-15:])))
    return results


def plan(args) -> list[tuple[int, str, Case]]:
    """(repeat, model, case) in run order: every repeat runs every model's rows."""
    try:
        import deepspeed  # noqa: F401
        ds_cases = DEEPSPEED_CASES
    except ImportError:
        ds_cases = []
    runs = []
    for repeat in range(1, args.repeats + 1):
        for item in args.models.split(","):
            role, _, model = item.rpartition("=")
            role = role or ("large" if model == "1.2b" else "small")
            for case in SUITES[args.suite][role] + ds_cases:
                if not args.only or any(f in case.label for f in args.only.split(",")):
                    runs.append((repeat, model, case))
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="all")
    p.add_argument("--models", default="82m,1.2b", help="comma-separated, run in this order: 1.2b runs the "
                   "'large' rows, tiny and 82m the 'small' ones; ROLE=MODEL picks the rows (large=tiny)")
    p.add_argument("--repeats", type=int, default=1, help="run the whole list this many times, one after the other")
    p.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--device", default=None, help="cuda (default when a GPU is visible) or cpu")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    p.add_argument("--budget_s", type=float, default=None, help="start no row after this many seconds; a running "
                   "row is cut there")
    p.add_argument("--out", default=None, help="also write the table (markdown) here, after every row")
    p.add_argument("--logs", type=Path, default=None, help="write each row's whole output into this folder")
    p.add_argument("--wheels", type=Path, default=None, help="install the run-time packages from these wheels "
                   "into build/gpu-site first (make gpu-wheels)")
    p.add_argument("--only", default=None, help="comma-separated label fragments: run only rows whose label "
                   "contains one (e.g. 'plain,offload')")
    p.add_argument("--no_extra", action="store_true", help="skip bench/gpu/*_check.py")
    args = p.parse_args()
    roles = {item.rpartition("=")[0] for item in args.models.split(",")} - {""}
    if roles - set(SUITES[args.suite]):
        p.error(f"--models: unknown role(s) {sorted(roles - set(SUITES[args.suite]))}; the roles are "
                f"{sorted(SUITES[args.suite])} (e.g. large=tiny)")
    t0 = time.perf_counter()
    header = [f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}"]
    if args.wheels:
        site = ROOT / "build" / "gpu-site"
        header.append(f"run-time packages installed from {args.wheels} in {wheels.install(args.wheels, site):.0f} s")
    wheels.activate(site if args.wheels else None)
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    header.append(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
                  f"{os.cpu_count()} CPUs")
    print("\n".join(header), flush=True)
    t_ops = time.perf_counter()
    built = prebuild_ops(device, args.timeout)
    header.append(f"native ops built in {time.perf_counter() - t_ops:.0f} s: " + "; ".join(built.splitlines()))
    print(header[-1], flush=True)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    runs, rows, skipped = plan(args), [], []
    for n, (repeat, model, case) in enumerate(runs):
        left = args.timeout if args.budget_s is None else min(args.timeout, args.budget_s - (time.perf_counter() - t0))
        if left <= 0:
            skipped.append(f"{model} run {repeat} {case.label}")
            continue
        name = f"{n:02d}-{model}-{re.sub(r'[^A-Za-z0-9.]+', '_', case.label)}-{repeat}.log"
        log = args.logs / name if args.logs else None
        r = run_case(case, model, ["--steps", str(args.steps), "--warmup", str(args.warmup)], device, left, log)
        r["repeat"] = repeat
        rows.append(r)
        losses = r.get("losses") or [float("nan")]
        print(f"{model:5} {repeat} {case.label:44} rc={r['rc']} {r['wall_s']:.0f} s "
              f"{r.get('step_ms_median', float('nan')):.1f} ms {r.get('peak_mib', float('nan')):,.0f} MiB "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" + (f"\n{r['error']}" if r["rc"] else ""), flush=True)
        judge(rows)
        if args.out:  # the table so far: a run stopped by a time limit still leaves its rows
            Path(args.out).write_text("\n".join(header) + "\n\n" + table(rows) + "\n")
    extra_left = args.timeout if args.budget_s is None else args.budget_s - (time.perf_counter() - t0)
    checks = [] if args.no_extra or extra_left <= 0 else extra_checks(
        device, min(args.timeout, extra_left), {c.script for _, _, c in runs})
    if not args.no_extra and extra_left <= 0:
        skipped.append("the bench/gpu/*_check.py checks")
    text = "\n".join(header) + "\n\n" + table(rows) + timelines(rows)
    if skipped:
        text += f"\n\nskipped (past --budget_s {args.budget_s:.0f} s): " + "; ".join(skipped)
    for name, rc, tail in checks:
        text += f"\n\n{name}: {'ok' if rc == 0 else f'FAIL (exit {rc})'}\n\n    " + tail.replace("\n", "\n    ")
    text += f"\n\ntotal {time.perf_counter() - t0:.0f} s"
    print("\n" + text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failed = [r for r in rows if not r["ok"]] + [c for c in checks if c[1] != 0]
    return 1 if failed or skipped else 0


if __name__ == "__main__":
    sys.exit(main())

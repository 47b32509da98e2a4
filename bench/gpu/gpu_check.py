"""`make gpu-check`: dsrun on one GPU, every configuration a user reaches, as one table.

    python bench/gpu/gpu_check.py [--models 82m,1.2b] [--out bench/gpu/last_run.md]
    python bench/gpu/gpu_check.py --device cpu --models tiny     # a smoke test without a GPU

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

The native ops are built first, in parallel (TORCH_CUDA_ARCH_LIST is set to
the present GPU's unless given). Printed: per configuration the median and
minimum step time (ms), peak device memory (MiB, torch.cuda.max_memory_allocated),
first and last loss and the first loss's distance from plain PyTorch's (same
weights, same batch; bf16 weights move it by about 1e-3). A row fails when
its process fails, a loss is not finite, its first loss is more than 0.05
from plain PyTorch's, or a resume differs; the exit status is non-zero when
any row fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FIRST_LOSS_TOLERANCE = 0.05  # nats; bf16 weights against fp32 ones move the first loss by ~1e-3

# (label, gpt_case.py arguments): the 1.2B model runs the "large" rows, any other the "small" ones.
CASES = {
    "small": [
        ("plain PyTorch", ["--run", "plain"]),
        ("stage 0", ["--stage", "0"]),
        ("stage 1", ["--stage", "1"]),
        ("stage 2", ["--stage", "2"]),
        ("stage 3", ["--stage", "3"]),
        ("stage 2 fp16", ["--stage", "2", "--fp16"]),
        ("stage 3 fp16", ["--stage", "3", "--fp16"]),
        ("stage 3 zero.Init", ["--stage", "3", "--zero_init"]),
        ("stage 3 activation checkpointing", ["--stage", "3", "--act_ckpt"]),
        ("stage 2 offload_optimizer cpu", ["--stage", "2", "--offload_optimizer", "cpu", "--timeline"]),
        ("stage 3 offload_optimizer nvme", ["--stage", "3", "--offload_optimizer", "nvme"]),
        ("stage 3 offload_param cpu", ["--stage", "3", "--offload_param", "cpu"]),
        ("stage 3 offload_param nvme", ["--stage", "3", "--offload_param", "nvme", "--offload_optimizer", "nvme"]),
        ("stage 2 checkpoint resume", ["--stage", "2", "--resume"]),
        ("stage 3 checkpoint resume", ["--stage", "3", "--resume"]),
    ],
    "large": [
        ("plain PyTorch", ["--run", "plain"]),
        ("stage 0", ["--stage", "0"]),
        ("stage 3", ["--stage", "3"]),
        ("stage 3 zero.Init", ["--stage", "3", "--zero_init"]),
        ("stage 2 offload_optimizer cpu", ["--stage", "2", "--offload_optimizer", "cpu", "--timeline"]),
        ("stage 3 offload_param cpu", ["--stage", "3", "--offload_param", "cpu", "--offload_optimizer", "cpu"]),
    ],
}
DEEPSPEED_CASES = [
    ("DeepSpeed stage 0", ["--run", "deepspeed", "--stage", "0"]),
    ("DeepSpeed stage 3", ["--run", "deepspeed", "--stage", "3"]),
    ("DeepSpeed stage 2 offload_optimizer cpu", ["--run", "deepspeed", "--stage", "2", "--offload_optimizer", "cpu"]),
]


def prebuild_ops(device: str) -> str:
    """Build every native op this machine supports, one process per op, in parallel."""
    from dsrun.ops.builder import OPS
    names = [n for n, spec in OPS.items() if device == "cuda" or not spec.requires_cuda]
    code = "import sys; from dsrun.ops.builder import get_op; op = get_op(sys.argv[1]); op.load(); print(sys.argv[1], op.reason or 'loaded')"
    procs = [subprocess.Popen([sys.executable, "-c", code, n], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=ROOT) for n in names]
    return "\n".join(p.communicate()[0].strip().splitlines()[-1] for p in procs)


def run_case(label: str, model: str, argv: list[str], device: str, timeout: float) -> dict:
    """Run one configuration; its RESULT line as a dict plus label, wall time and status."""
    cmd = [sys.executable, str(HERE / "gpt_case.py"), "--model", model, "--device", device, *argv]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout:.0f} s", -1
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT "):]) if lines else {}
    result.update(label=label, model=model, rc=rc, wall_s=time.perf_counter() - t0)
    if rc != 0:
        result["error"] = "\n".join(out.strip().splitlines()[-12:])
    return result


def judge(rows: list[dict]) -> None:
    """Set each row's `ok` and `note` (see the module docstring for the rules)."""
    plain = {r["model"]: r["losses"][0] for r in rows if r["label"] == "plain PyTorch" and r.get("losses")}
    for r in rows:
        notes = []
        if r["rc"] != 0:
            notes.append("failed: " + r.get("error", "").splitlines()[-1][:160] if r.get("error") else "failed")
        losses = r.get("losses", [])
        if losses and not all(math.isfinite(v) for v in losses):
            notes.append("non-finite loss")
        if losses and r["model"] in plain:
            r["d_first"] = abs(losses[0] - plain[r["model"]])
            if r["d_first"] > FIRST_LOSS_TOLERANCE:
                notes.append(f"first loss {losses[0]:.4f} vs plain {plain[r['model']]:.4f}")
        if r.get("resume_equal") is False:
            notes.append("resumed losses differ")
        r["ok"], r["note"] = not notes, "; ".join(notes)


def table(rows: list[dict]) -> str:
    head = ("| model | configuration | step ms median (min) | peak MiB | loss first -> last | "
            "\u0394 first vs plain | result |\n|---|---|---|---|---|---|---|")
    out = [head]
    for r in rows:
        ms = f"{r['step_ms_median']:.1f} ({r['step_ms_min']:.1f})" if "step_ms_median" in r else "-"
        peak = f"{r['peak_mib']:,.0f}" if "peak_mib" in r else "-"
        losses = r.get("losses")
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else (
            "resume equal" if r.get("resume_equal") else "-")
        d = f"{r['d_first']:.4f}" if "d_first" in r else "-"
        out.append(f"| {r['model']} | {r['label']} | {ms} | {peak} | {loss} | {d} | "
                   f"{'ok' if r['ok'] else 'FAIL: ' + r['note']} |")
    return "\n".join(out)


def timelines(rows: list[dict]) -> str:
    """The offload timelines of the rows run with --timeline, as indented text ('' when none)."""
    from dsrun.runtime.offload.transfer import format_timeline

    out = []
    for r in rows:
        if "build_s" in r:
            chart = format_timeline(r.get("timeline") or {}) or "no offload timeline (nothing offloaded)"
            out.append(f"{r['model']} {r['label']}: initialize {r['build_s']:.1f} s, peak "
                       f"{r['build_peak_mib']:,.0f} MiB by then\n\n    " + chart.replace("\n", "\n    "))
    return "".join("\n\n" + t for t in out)


def extra_checks(device: str, timeout: float) -> list[tuple[str, int, str]]:
    """Run bench/gpu/*_check.py (other than this file): (name, exit status, last lines)."""
    results = []
    for script in sorted(HERE.glob("*_check.py")):
        if script.name == Path(__file__).name:
            continue
        try:
            proc = subprocess.run([sys.executable, str(script), "--device", device], capture_output=True,
                                  text=True, timeout=timeout, cwd=ROOT)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            rc, out = -1, f"timed out after {timeout:.0f} s"
        results.append((script.name, rc, "\n".join(out.strip().splitlines()[-15:])))
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="82m,1.2b", help="comma-separated, run in this order: 1.2b runs the "
                   "'large' rows, tiny and 82m the 'small' ones")
    p.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--device", default=None, help="cuda (default when a GPU is visible) or cpu")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--only", default=None, help="comma-separated label fragments: run only rows whose label "
                   "contains one (e.g. 'plain,offload')")
    p.add_argument("--no_extra", action="store_true", help="skip bench/gpu/*_check.py")
    args = p.parse_args()
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    t0 = time.perf_counter()
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}",
          flush=True)
    print(prebuild_ops(device), f"\nops built in {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        import deepspeed  # noqa: F401
        ds_cases = DEEPSPEED_CASES
    except ImportError:
        ds_cases = []
    rows = []
    for model in args.models.split(","):
        cases = CASES["large" if model == "1.2b" else "small"] + ds_cases
        for label, argv in cases:
            if args.only and not any(f in label for f in args.only.split(",")):
                continue
            r = run_case(label, model, [*argv, "--steps", str(args.steps), "--warmup", str(args.warmup)],
                          device, args.timeout)
            rows.append(r)
            losses = r.get("losses") or [float("nan")]
            print(f"{model:5} {label:40} rc={r['rc']} {r['wall_s']:.0f} s "
                  f"{r.get('step_ms_median', float('nan')):.1f} ms {r.get('peak_mib', float('nan')):,.0f} MiB "
                  f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" + (f"\n{r['error']}" if r["rc"] else ""), flush=True)
            judge(rows)
            if args.out:  # the table so far: a run stopped by a time limit still leaves its rows
                Path(args.out).write_text(table(rows) + "\n")
    text = table(rows) + timelines(rows)
    checks = [] if args.no_extra else extra_checks(device, args.timeout)
    for name, rc, tail in checks:
        text += f"\n\n{name}: {'ok' if rc == 0 else f'FAIL (exit {rc})'}\n\n    " + tail.replace("\n", "\n    ")
    print("\n" + text + f"\n\ntotal {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failed = [r for r in rows if not r["ok"]] + [c for c in checks if c[1] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

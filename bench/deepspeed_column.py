"""The DeepSpeed column of dsrun's benchmarks: the same client script run
under torchrun once with dsrun and once with DeepSpeed, interleaved.

A DeepSpeed venv is named with `--deepspeed-venv V` or the environment
variable DSRUN_BENCH_DEEPSPEED=V (V/bin/torchrun and V/bin/python must
exist; make one with `python3 -m venv V && V/bin/pip install torch==2.13.0
&& DS_BUILD_OPS=0 V/bin/pip install deepspeed==0.19.8`). Without one a
benchmark runs dsrun alone and says so. DeepSpeed runs on the CPU with
DS_ACCELERATOR=cpu and CUDA_VISIBLE_DEVICES empty. dsrun runs with this
checkout's .venv, where `import deepspeed` fails or finds dsrun's alias.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "DSRUN_BENCH_DEEPSPEED"


def deepspeed_venv(option: str | None) -> Path | None:
    """The DeepSpeed venv named by the option, else by DSRUN_BENCH_DEEPSPEED, else None.

    Raises:
        SystemExit: the named directory has no bin/torchrun.
    """
    name = option or os.environ.get(ENV_VAR, "").strip() or None
    if name is None:
        return None
    venv = Path(name)
    if not (venv / "bin" / "torchrun").exists():
        raise SystemExit(f"--deepspeed-venv / {ENV_VAR}={name}: no bin/torchrun there; create the venv with "
                         "torch==2.13.0 and deepspeed==0.19.8 (see bench/deepspeed_column.py)")
    return venv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_variant(variant: str) -> tuple[str, Path, dict[str, str]]:
    """A run's name -> (library, checkout, environment):
    "dsrun:A=1:B=2" -> ("dsrun", this checkout, {"A": "1", "B": "2"});
    "dsrun@DIR" runs the dsrun checkout DIR with its own DIR/.venv (e.g. an
    earlier commit, for a before/after column); "deepspeed" the named venv.

    Raises:
        SystemExit: not deepspeed or dsrun[@DIR], a setting without "=", or DIR has no .venv/bin/torchrun.
    """
    name, *settings = variant.split(":")
    library, _, checkout = name.partition("@")
    if library not in ("deepspeed", "dsrun") or any("=" not in kv for kv in settings) \
            or (checkout and library != "dsrun"):
        raise SystemExit(f"{variant!r}: a run is deepspeed, dsrun or dsrun@CHECKOUT, optionally followed by "
                         ":NAME=VALUE settings")
    where = Path(checkout) if checkout else ROOT
    if library == "dsrun" and not (where / ".venv" / "bin" / "torchrun").exists():
        raise SystemExit(f"{variant!r}: {where}/.venv/bin/torchrun is missing (run make install there)")
    return library, where, dict(kv.split("=", 1) for kv in settings)


def launch(variant: str, venv: Path | None, script: Path, nprocs: int, args: list[str],
           timeout: float = 900.0) -> dict:
    """Run `script args` on `nprocs` local ranks with torchrun from `venv`
    (DeepSpeed) or this checkout's .venv (dsrun), `variant` as in
    `split_variant`, and return the JSON its rank 0 printed after "RESULT ".

    Raises:
        RuntimeError: the launch failed or printed no result (its output's tail in the message).
    """
    library, checkout, settings = split_variant(variant)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **settings)
    if library == "deepspeed":
        torchrun = venv / "bin" / "torchrun"
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
        env.pop("PYTHONPATH", None)
    else:
        torchrun = checkout / ".venv" / "bin" / "torchrun"
    cmd = [str(torchrun), f"--nproc_per_node={nprocs}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(script), *args]
    done = subprocess.run(cmd, env=env, cwd=str(checkout if library == "dsrun" else ROOT), capture_output=True, text=True, timeout=timeout)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            if result["library"] != library:
                raise RuntimeError(f"asked for {library}, the client imported {result['library']}")
            return result
    raise RuntimeError(f"{library} launch failed (rc {done.returncode}): {' '.join(cmd)}\n"
                       f"{(done.stdout + done.stderr)[-4000:]}")


def summary(samples: list[float]) -> tuple[float, float, float]:
    """(min, median, spread = (max - min) / median) of `samples`."""
    mid = statistics.median(samples)
    return min(samples), mid, (max(samples) - min(samples)) / mid


def load_average() -> str:
    """The 1-minute load average and the CPU count, for the report."""
    return f"load average (1 min) {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs"


def run_interleaved(cases: dict[str, list[str]], variants: list[str], venv: Path | None, script: Path,
                    nprocs: int, repeats: int, extra=lambda variant: []) -> dict:
    """Launch `script` for every repeat, case and variant: cases in order,
    the variants' order reversed every other repeat (A B, B A, ...).
    `extra(variant)` adds arguments to a variant's launches.

    Returns:
        {"steps": {(case, variant): [step seconds]}, "cpu": {...: [CPU seconds per step]},
        "launches": {...: [median step seconds of each launch]}, "last": {...: the last launch's result},
        "results": {...: [every launch's result]}}.
    """
    out = {"steps": {}, "cpu": {}, "launches": {}, "last": {}, "results": {}}
    for repeat in range(repeats):
        for case, args in cases.items():
            for variant in (variants if repeat % 2 == 0 else variants[::-1]):
                result = launch(variant, venv, script, nprocs, args + extra(variant))
                key = (case, variant)
                out["steps"].setdefault(key, []).extend(result["step_s"])
                out["cpu"].setdefault(key, []).extend(result["cpu_s"])
                out["launches"].setdefault(key, []).append(statistics.median(result["step_s"]))
                out["last"][key] = result
                out["results"].setdefault(key, []).append(result)
                print(f"repeat {repeat} {case} {variant}: median {out['launches'][key][-1] * 1e3:.1f} ms", flush=True)
    return out


def table(results: dict, cases, variants: list[str]) -> str:
    """Markdown: per case, each variant's min / median / spread of its step
    times and median CPU ms per step (summed over ranks), then, when a
    "deepspeed" variant ran, each other variant's median over DeepSpeed's
    median and the range of the per-repeat ratios of launch medians."""
    ours = [v for v in variants if v != "deepspeed"]
    versus = "deepspeed" in variants
    head = "| case | " + " | ".join(f"{v}: min / median ms (spread), CPU ms" for v in variants)
    if versus:
        head += "".join(f" | {v} / DeepSpeed: medians, per repeat" for v in ours)
    head += " |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for case in cases:
        cells = []
        for v in variants:
            lo, mid, spread = summary(results["steps"][(case, v)])
            cells.append(f"{lo * 1e3:.1f} / {mid * 1e3:.1f} ({spread:.0%}), "
                         f"{statistics.median(results['cpu'][(case, v)]) * 1e3:.0f}")
        if versus:
            base = statistics.median(results["steps"][(case, "deepspeed")])
            for v in ours:
                per = [a / b for a, b in zip(results["launches"][(case, v)], results["launches"][(case, "deepspeed")])]
                cells.append(f"{statistics.median(results['steps'][(case, v)]) / base:.2f}, "
                             f"{min(per):.2f}-{max(per):.2f}")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

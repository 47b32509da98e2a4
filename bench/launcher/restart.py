"""Restart-to-first-step time after a rank failure, checkpoint load included,
beside a cold start of the same job.

    PYTHONPATH=$PWD .venv/bin/python bench/launcher/restart.py [--repeat 3] [--model 48m|small]

The job: the 48M GPT of bench/step_time/gpt_step.py (d=512, 10 layers, 8
heads, vocab 32000, seq 256, tied embedding/head, 48.0M parameters, fp32;
`--model small` is its 5.2M shape for quick loops), 2 local ranks under
`dsrun --num_procs 2` (`--max_restarts 1` for the restart case), ZeRO stage 1, dsrun's AdamW, micro-batch
2, one micro-batch per step, 1 torch thread per rank, config
`"checkpoint": {"auto_resume": true, "save_dir": ...}`.

Two cases, interleaved (repeat 1 runs cold then restart, repeat 2 again ...):

- cold: the job started on an empty save_dir (auto_resume finds nothing)
  and stopped after its first step. Phases from dsrun's start.
- restart: the job runs step 1, saves its checkpoint (about 576 MB: weights
  and both Adam moments, fp32), and rank 1 SIGKILLs itself inside step 2
  after its backward. dsrun tears the job down and starts it again; the
  restarted ranks auto-resume step 1's checkpoint and complete step 2.
  Phases from the kill.

Instrumentation is by wall-clock timestamps (time.time(), one machine): each
rank appends events to a file (its Python's first line, the start and end of
Engine.load_checkpoint -- wrapped by this script -- and the end of its first
step), the killed rank writes one just before its SIGKILL, and this script
stamps each line of dsrun's stderr as it arrives (`dsrun: restart 1/1 ...`
is printed once the old job is torn down and the host re-checked, just
before the new one starts). A boundary is the moment the last rank reaches
it (the job moves at its slowest rank's pace). The phases:

- teardown: the kill -> dsrun's restart line (restart only).
- launch: dsrun's start (cold) or its restart line (restart) -> the last
  rank's Python running its first line.
- initialize: -> the last rank entering load_checkpoint: importing torch and
  dsrun, building the model, initialize()'s process group and engine.
- checkpoint load: -> the last rank leaving load_checkpoint (on the cold
  start: finding that there is nothing to load).
- first step: -> the last rank done with forward, backward and optimizer
  step of its first step.

Reported per case and phase: min and median over the repeats, and the total.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("teardown", "launch", "initialize", "checkpoint load", "first step")


def _event(path: str, name: str, **extra) -> None:
    """Append one event line {"event", "t" (time.time() seconds), "rank", "restart", **extra} to `path`
    (O_APPEND: whole lines)."""
    line = json.dumps({"event": name, "t": time.time(), "rank": int(os.environ["RANK"]),
                       "restart": int(os.environ["DSRUN_RESTART_COUNT"]), **extra}) + "\n"
    with open(path, "a") as f:
        f.write(line)


def rank_main(save_dir: str, events: str, model: str, die: bool) -> None:
    """One rank of the job (argv after --rank): see the module docstring."""
    _event(events, "python")
    import signal

    import torch

    import dsrun
    from dsrun.runtime.engine.engine import Engine

    sys.path.insert(0, str(ROOT / "bench" / "step_time"))
    from gpt_step import GPT, MODELS

    torch.set_num_threads(1)
    restart = int(os.environ["DSRUN_RESTART_COUNT"])
    load = Engine.load_checkpoint

    def timed_load(self, *args, **kwargs):
        _event(events, "load_start")
        out = load(self, *args, **kwargs)
        _event(events, "load_end")
        return out

    Engine.load_checkpoint = timed_load
    s = MODELS[model]
    torch.manual_seed(0)
    engine, _, _, _ = dsrun.initialize(model=GPT(s), config={
        "train_batch_size": 2 * s.micro, "train_micro_batch_size_per_gpu": s.micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": s.bucket, "allgather_bucket_size": s.bucket},
        "checkpoint": {"auto_resume": True, "save_dir": save_dir}})
    first = True
    while engine.global_steps < 2:
        step = engine.global_steps + 1
        g = torch.Generator().manual_seed(step * 2 + engine.global_rank)
        tokens = torch.randint(0, s.vocab, (s.micro, s.seq + 1), generator=g)
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        if die and restart == 0 and step == 2 and engine.global_rank == 1:
            _event(events, "kill")
            os.kill(os.getpid(), signal.SIGKILL)
        engine.step()
        if first:
            _event(events, "first_step", step=step)
            first = False
            if not die:
                return  # the cold start stops after its first step
        if step == 1:
            engine.save_checkpoint(save_dir)


def _run_job(case: str, model: str, work: Path, port: int) -> dict[str, float]:
    """Run one case; returns {phase: seconds}. Raises RuntimeError with dsrun's output when the job fails."""
    events, save_dir = work / f"{case}.events", work / f"{case}-ckpt"
    events.unlink(missing_ok=True)
    shutil.rmtree(save_dir, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", "2", "--master_port", str(port),
            "--no_local_rank", "--max_restarts", "1" if case == "restart" else "0", __file__, "--rank",
            str(save_dir), str(events), model, "die" if case == "restart" else "cold"]
    lines: list[tuple[float, str]] = []
    start = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.time(), line))

    reader = threading.Thread(target=read)
    reader.start()
    rc = proc.wait(timeout=900)
    reader.join()
    shutil.rmtree(save_dir, ignore_errors=True)
    log = "".join(line for _, line in lines)
    if rc != 0:
        raise RuntimeError(f"{case} job failed ({rc}):\n{log[-3000:]}")
    ev = [json.loads(line) for line in events.read_text().splitlines()]
    attempt = 1 if case == "restart" else 0

    def last(name: str) -> float:
        times = [e["t"] for e in ev if e["event"] == name and e["restart"] == (0 if name == "kill" else attempt)]
        if len(times) != (1 if name == "kill" else 2):
            raise RuntimeError(f"{case}: expected the {name} event of every rank, got {times}:\n{log[-3000:]}")
        return max(times)

    if case == "restart":
        killed = last("kill")
        begin = next(t for t, line in lines if "dsrun: restart 1/1" in line)
        phases = {"teardown": begin - killed}
    else:
        begin, phases = start, {}
    python, load_start, load_end, stepped = (last(n) for n in ("python", "load_start", "load_end", "first_step"))
    phases.update({"launch": python - begin, "initialize": load_start - python,
                   "checkpoint load": load_end - load_start, "first step": stepped - load_end})
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", choices=("48m", "small"), default="48m")
    parser.add_argument("--rank", nargs=4, metavar=("SAVE_DIR", "EVENTS", "MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        save_dir, events, model, mode = args.rank
        rank_main(save_dir, events, model, mode == "die")
        return
    sys.path.insert(0, str(ROOT))
    from tests.dist_helpers import free_port

    results: dict[str, list[dict[str, float]]] = {"cold": [], "restart": []}
    with tempfile.TemporaryDirectory(prefix="dsrun-restart-bench-") as tmp:
        for rep in range(args.repeat):
            for case, runs in results.items():
                phases = _run_job(case, args.model, Path(tmp), free_port())
                runs.append(phases)
                print(f"repeat {rep + 1} {case}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()),
                      f"total {sum(phases.values()):.2f} s", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f}; {args.repeat} repeat(s), model {args.model}\n")
    print("| case | " + " | ".join(f"{p} s" for p in PHASES) + " | total s |")
    print("|---|" + "---:|" * (len(PHASES) + 1))
    for case, runs in results.items():
        cells = []
        for phase in (*PHASES, "total"):
            values = [sum(r.values()) if phase == "total" else r.get(phase) for r in runs]
            cells.append("-" if values[0] is None else f"{min(values):.2f} / {statistics.median(values):.2f}")
        print(f"| {case} (min / median) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

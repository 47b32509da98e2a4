"""Checkpoint save/load time per ZeRO stage on 2 ranks, against torch.save and the disk.

    .venv/bin/python bench/checkpoint/bench_checkpoint.py [--layers 8] [--width 704] [--stages 0,1,2,3]
        [--precision fp32|bf16] [--dir /tmp/dsrun-ckpt-bench] [--repeats 1]

Model: examples/gpt_model.py's GPT (default 8 layers x 704 wide: 48M
parameters), AdamW, one training step so the optimizer holds its states.
Per stage, a fresh pair of ranks (gloo, 1 torch thread each) measures, on
rank 0 (both ranks take part; times are wall clock between barriers):

  save        engine.save_checkpoint, blocking (write, fsync, commit)
  async stall the time save_checkpoint takes with checkpoint.async_save
              (the host snapshot), and async total until wait_checkpoint()
  load        engine.load_checkpoint on the same 2 ranks
  load 1 rank the same checkpoint loaded by a single process at stage 0
  torch.save  each rank torch.save's its module + optimizer state_dict
              (pickled, to one file per rank, fsynced): the usual baseline
  bytes       size of the checkpoint directory

and, once, fio's sequential write bandwidth (1 MiB blocks, fsync at the end,
2 jobs, in --dir) when fio is installed. The "save GB/s" column is bytes /
save time: the goal is >= 0.8x fio's bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(args, stage: int):
    import dsrun
    from examples.gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=8, seq_len=64))
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
           "steps_per_print": 10**9, "checkpoint": {}}
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = dsrun.initialize(model=model, optimizer=opt, config=cfg)
    x = torch.randint(0, 256, (1, 64))
    engine.backward(engine(x, x))
    engine.step()
    return engine


def _timed(fn) -> float:
    from dsrun.runtime import comm
    comm.barrier()
    t = time.perf_counter()
    fn()
    comm.barrier()
    return time.perf_counter() - t


def _worker(rank: int, world: int, port: int, args, stage: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    engine = _engine(args, stage)
    root = os.path.join(args.dir, f"stage{stage}")
    row = {}
    row["save"] = _timed(lambda: engine.save_checkpoint(root, tag="sync"))
    engine.config.checkpoint.async_save = True
    t0 = time.perf_counter()
    stall = _timed(lambda: engine.save_checkpoint(root, tag="async"))
    row["async_stall"] = stall
    engine.wait_checkpoint()
    row["async_total"] = time.perf_counter() - t0
    engine.config.checkpoint.async_save = False
    row["load"] = _timed(lambda: engine.load_checkpoint(root, tag="sync"))
    path = os.path.join(root, f"torch_save_rank{rank}.pt")

    def torch_save():
        with open(path, "wb") as f:
            torch.save({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
    row["torch_save"] = _timed(torch_save)
    tag_dir = os.path.join(root, "sync")
    row["bytes"] = sum(os.path.getsize(os.path.join(tag_dir, f)) for f in os.listdir(tag_dir))
    if rank == 0:
        queue.put(row)
    import torch.distributed as dist
    dist.destroy_process_group()


def _load_alone(args, stage: int, queue) -> None:
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)
    engine = _engine(args, 0)
    t = time.perf_counter()
    engine.load_checkpoint(os.path.join(args.dir, f"stage{stage}"), tag="sync")
    queue.put(time.perf_counter() - t)


def _fio(directory: str) -> float | None:
    if shutil.which("fio") is None:
        return None
    out = subprocess.run(["fio", "--name=w", f"--directory={directory}", "--rw=write", "--bs=1M",
                          "--size=256M", "--numjobs=2", "--end_fsync=1", "--group_reporting",
                          "--output-format=json"], capture_output=True, text=True, check=True).stdout
    bw = json.loads(out)["jobs"][0]["write"]["bw_bytes"]
    for f in os.listdir(directory):
        if f.startswith("w."):
            os.unlink(os.path.join(directory, f))
    return bw / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=704)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--dir", default="/tmp/dsrun-ckpt-bench")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    fio = _fio(args.dir)
    print(f"fio sequential write, 2 jobs: {fio:.2f} GB/s" if fio else "fio not installed")
    print(f"{'stage':>5} {'GB':>6} {'save s':>7} {'GB/s':>6} {'async stall':>11} {'async total':>11} "
          f"{'load s':>7} {'load 1 rank':>11} {'torch.save':>10}")
    for stage in (int(s) for s in args.stages.split(",")):
        queue = ctx.Queue()
        port = _port()
        procs = [ctx.Process(target=_worker, args=(r, 2, port, args, stage, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        row = queue.get(timeout=1800)
        for proc in procs:
            proc.join()
        alone = ctx.Process(target=_load_alone, args=(args, stage, queue))
        alone.start()
        row["load_1"] = queue.get(timeout=1800)
        alone.join()
        gb = row["bytes"] / 1e9
        print(f"{stage:>5} {gb:>6.2f} {row['save']:>7.2f} {gb / row['save']:>6.2f} {row['async_stall']:>11.3f} "
              f"{row['async_total']:>11.2f} {row['load']:>7.2f} {row['load_1']:>11.2f} {row['torch_save']:>10.2f}",
              flush=True)
        shutil.rmtree(os.path.join(args.dir, f"stage{stage}"))


if __name__ == "__main__":
    main()

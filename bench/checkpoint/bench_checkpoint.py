"""Checkpoint save/load per ZeRO stage on 2 ranks: dsrun against the disk (fio),
torch.save, PyTorch DCP and DeepSpeed.

    .venv/bin/python bench/checkpoint/bench_checkpoint.py [--stages 0,1,2,3] [--repeats 3]
        [--precision fp32|bf16] [--layers 8] [--width 704] [--dir /tmp/dsrun-ckpt-bench]
        [--deepspeed /tmp/ds_pkgs]

Model: examples/gpt_model.py's GPT (default 8 layers x 704 wide: 48M
parameters), AdamW, one training step so the optimizer holds its states.
Each repeat runs, per stage, a fresh pair of ranks (gloo, 1 torch thread
each) that measures, in this order, on rank 0 (wall clock between barriers,
so the slower rank counts):

  fio         the disk's sequential write bandwidth in --dir, run by rank 0
              while rank 1 waits: 2 jobs, 1 MiB blocks, fsync at the end, as
              many bytes as the checkpoint; buffered and O_DIRECT, the better
              counts ("disk GB/s")
  save        engine.save_checkpoint, blocking (write, fsync, commit)
  async stall save_checkpoint with checkpoint.async_save plus the time the
              next engine.step() spends making the save stop reading the
              state ([Note: copy-on-write snapshot]); "async total" until
              wait_checkpoint() returns
  torch.save  each rank torch.save's its module + optimizer state_dict
              (pickled, one file per rank, fsynced)
  dcp save    torch.distributed.checkpoint.save of the same tensors dsrun
              writes (each rank's slices under its own keys, so nothing is
              deduplicated away), default FileSystemWriter (fsync on)
  dcp stall   dcp.async_save's call (its copy to host memory); total until
              the future is done
  load        engine.load_checkpoint (same 2 ranks), dcp.load of the same
              tensors, and the dsrun checkpoint loaded by one process at
              stage 0 ("load 1 proc", a fresh process, its start excluded);
              that process then saves the same state itself and loads it
              back ("load 1 proc same-size": the same bytes read by the
              same process without resharding), then loads the 2-rank
              checkpoint again ("again": like "same-size", its optimizer
              states exist already; the first load allocates them);
              "reshard/same" = again / same-size, the issue's "load on
              another world size / same-size load"
              "load MB read by rank 0": what rank 0 read from the disk during
              the 2-rank load (/proc/self/io); "load broadcasts" / "load
              broadcast s": the broadcasts that handed each rank the parts of
              replicated state the other read, and their time
              (engine.comm_stats())
  pruning     the same state saved into an empty directory ("save again":
              a later save of the same engine, unlike "save" above), then
              saved again there with checkpoint.keep_last=1, which deletes
              the first ("save pruning"; "pruning/again" is their ratio)

then, with --deepspeed DIR (a directory holding DeepSpeed, e.g. made by
`DS_BUILD_OPS=0 pip install --target DIR --no-deps deepspeed==0.19.8 hjson
py-cpuinfo msgpack tqdm einops nvidia-ml-py`), a pair of DeepSpeed ranks
(DS_ACCELERATOR=cpu, gloo) on the same model and stage: save_checkpoint and
load_checkpoint. Configurations alternate within every repeat (dsrun pair,
1-process load, DeepSpeed pair, next stage, ...). "+RSS MiB": how far rank
0's resident memory rose above its level before the call, at its peak during
the call (Linux's peak-RSS counter, reset before each). "save device write
requests": requests the disk holding --dir completed during the save
(/proc/diskstats), the count that memory on 2 MiB pages lowers. The table gives the
median over repeats and the min-max spread; ratios are taken per repeat
before the median. Goals of issue 9: save time <= 1.25x the time the disk needs for
the same bytes (fio), async stall <= 0.1x the blocking save, reshard/same
<= 1.2x.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(args):
    from examples.gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=8, seq_len=64))


def _config(args, stage: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train_step(engine) -> None:
    x = torch.randint(0, 256, (1, 64))
    engine.backward(engine(x, x))
    engine.step()


def _timed(fn) -> float:
    import torch.distributed as dist
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _rss_mark() -> int:
    """Restart the process's peak RSS (Linux: clear_refs 5) and return its
    RSS now, in bytes; `_rss_extra(mark)` is then the most it grew since."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))


def _read_bytes() -> int:
    """Bytes this process has had read from storage so far (/proc/self/io
    read_bytes: O_DIRECT reads included, page-cache hits not)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _rss_extra(mark: int) -> int:
    return _status_bytes("VmHWM") - mark


def _device_writes(directory: str) -> int | None:
    """Write requests completed so far by the block device holding
    `directory` (/proc/diskstats field 8); None where it cannot be found."""
    dev = os.stat(directory).st_dev
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if os.makedev(int(fields[0]), int(fields[1])) == dev:
                    return int(fields[7])
    except OSError:
        pass
    return None


def _measured(row: dict, key: str, fn, directory: str | None = None) -> None:
    """row[key]: `_timed(fn)`; row[key + "_rss"]: this rank's peak RSS during
    it above its RSS before, bytes; with `directory`, row[key + "_requests"]:
    write requests its device completed meanwhile (both ranks')."""
    mark = _rss_mark()
    before = _device_writes(directory) if directory else None
    row[key] = _timed(fn)
    row[key + "_rss"] = _rss_extra(mark)
    if before is not None:
        row[key + "_requests"] = _device_writes(directory) - before


def _fio(directory: str, nbytes: int, direct: bool) -> float:
    """fio's sequential write bandwidth (GB/s), 2 jobs writing nbytes in all."""
    size = max(nbytes // 2 // (1 << 20), 16)
    out = subprocess.run(["fio", "--name=w", f"--directory={directory}", "--rw=write", "--bs=1M",
                          f"--size={size}M", "--numjobs=2", "--end_fsync=1", f"--direct={int(direct)}",
                          "--group_reporting", "--output-format=json"],
                         capture_output=True, text=True, check=True).stdout
    for f in os.listdir(directory):
        if f.startswith("w."):
            os.unlink(os.path.join(directory, f))
    return json.loads(out)["jobs"][0]["write"]["bw_bytes"] / 1e9


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _dsrun_worker(rank: int, world: int, port: int, args, stage: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import dsrun
    from dsrun.runtime.checkpoint.parts import held_pieces
    from dsrun.runtime.checkpoint.save import rank_payload

    model = _model(args)
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  config=_config(args, stage))
    _train_step(engine)
    root = os.path.join(args.dir, f"dsrun{stage}")
    row = {}
    nbytes = 12 * sum(p.numel() for p in model.parameters())  # fp32 values + 2 Adam states
    dist.barrier()
    if rank == 0 and shutil.which("fio"):
        row["fio_buffered"] = _fio(args.dir, nbytes, direct=False)
        row["fio_direct"] = _fio(args.dir, nbytes, direct=True)
        row["fio"] = max(row["fio_buffered"], row["fio_direct"])
    _measured(row, "save", lambda: engine.save_checkpoint(root, tag="sync"), args.dir)
    row["bytes"] = _du(os.path.join(root, "sync"))
    engine.config.checkpoint.async_save = True
    t0 = time.perf_counter()
    row["async_call"] = _timed(lambda: engine.save_checkpoint(root, tag="async"))
    job = engine.checkpointer.pending
    _train_step(engine)  # the step makes the save stop reading the state (copy-on-write)
    row["async_stall"] = row["async_call"] + job.release_s
    engine.wait_checkpoint()
    dist.barrier()
    row["async_total"] = time.perf_counter() - t0
    engine.config.checkpoint.async_save = False

    path = os.path.join(root, f"torch_save_rank{rank}.pt")

    def torch_save():
        with open(path, "wb") as f:
            torch.save({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
    _measured(row, "torch_save", torch_save)
    parts = engine.checkpointer.parts
    tensors = rank_payload(parts, held_pieces(parts), {}, False)[0]
    state = {f"rank{rank}/{k}": t.clone() for k, t in tensors.items()}  # as dsrun's: this rank's slices
    _measured(row, "dcp_save", lambda: dcp.save(state, checkpoint_id=os.path.join(root, "dcp")))
    row["dcp_bytes"] = _du(os.path.join(root, "dcp"))
    # Its own group: the background save's collectives would otherwise race
    # the barriers below on the default group (a deadlock, seen once).
    dcp_group = dist.new_group(backend="gloo")
    t0 = time.perf_counter()
    future = None

    def dcp_async():
        nonlocal future
        future = dcp.async_save(state, checkpoint_id=os.path.join(root, "dcp_async"), process_group=dcp_group)
    row["dcp_stall"] = _timed(dcp_async)
    future.result()
    dist.barrier()
    row["dcp_async_total"] = time.perf_counter() - t0
    comm_before, read_before = engine.comm_stats().get("broadcast"), _read_bytes()
    _measured(row, "load", lambda: engine.load_checkpoint(root, tag="sync"))
    row["load_read"] = _read_bytes() - read_before
    after = engine.comm_stats().get("broadcast")
    if after is not None:  # the replicated parts sent to the other rank (see [Note: replicated loads])
        row["load_bcast_calls"] = after.calls - (comm_before.calls if comm_before else 0)
        row["load_bcast_s"] = after.seconds - (comm_before.seconds if comm_before else 0.0)
    _measured(row, "dcp_load", lambda: dcp.load(state, checkpoint_id=os.path.join(root, "dcp")))
    # Saving with checkpoint.keep_last=1 next to one checkpoint of the same size (it is pruned).
    pruned = os.path.join(args.dir, f"dsrun{stage}-keep")
    _measured(row, "save_again", lambda: engine.save_checkpoint(pruned, tag="old"))
    engine.config.checkpoint.keep_last = 1
    _measured(row, "save_prune", lambda: engine.save_checkpoint(pruned, tag="new"))
    if rank == 0:
        queue.put(row)
    dist.destroy_process_group()


def _load_alone(args, stage: int, queue) -> None:
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)
    import dsrun

    model = _model(args)
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  config=_config(args, 0))
    t = time.perf_counter()
    engine.load_checkpoint(os.path.join(args.dir, f"dsrun{stage}"), tag="sync")
    row = {"load_1": time.perf_counter() - t}
    root = os.path.join(args.dir, f"dsrun{stage}", "alone")  # the same state, saved by this one process
    engine.save_checkpoint(root, tag="same")
    t = time.perf_counter()
    engine.load_checkpoint(root, tag="same")
    row["load_1_same"] = time.perf_counter() - t
    t = time.perf_counter()  # again, now that the optimizer states exist, as they did for "same"
    engine.load_checkpoint(os.path.join(args.dir, f"dsrun{stage}"), tag="sync")
    row["load_1_again"] = time.perf_counter() - t
    queue.put(row)


def _deepspeed_worker(rank: int, world: int, port: int, args, stage: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    sys.path.insert(0, args.deepspeed)
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 (the attribute deepspeed.comm.torch is torch itself)
    import torch.distributed as dist

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # its CPU all-reduce compiles for minutes
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(args)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=_config(args, stage))
    _train_step(engine)
    root = os.path.join(args.dir, f"deepspeed{stage}")
    row = {}
    _measured(row, "ds_save", lambda: engine.save_checkpoint(root, tag="sync"))
    row["ds_bytes"] = _du(os.path.join(root, "sync"))
    _measured(row, "ds_load", lambda: engine.load_checkpoint(root, tag="sync"))
    if rank == 0:
        queue.put(row)
    dist.destroy_process_group()


def _pair(ctx, target, args, stage: int) -> dict:
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=target, args=(r, 2, port, args, stage, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    row = queue.get(timeout=1800)
    for proc in procs:
        proc.join()
    return row


def _alone(ctx, args, stage: int) -> dict:
    queue = ctx.Queue()
    proc = ctx.Process(target=_load_alone, args=(args, stage, queue))
    proc.start()
    row = queue.get(timeout=1800)
    proc.join()
    return row


COLUMNS = [  # (heading, function of one repeat's row, format)
    ("GB", lambda r: r["bytes"] / 1e9, "{:.3f}"),
    ("disk GB/s", lambda r: r.get("fio"), "{:.2f}"),
    ("fio buffered GB/s", lambda r: r.get("fio_buffered"), "{:.2f}"),
    ("fio O_DIRECT GB/s", lambda r: r.get("fio_direct"), "{:.2f}"),
    ("save s", lambda r: r["save"], "{:.3f}"),
    ("save GB/s", lambda r: r["bytes"] / r["save"] / 1e9, "{:.2f}"),
    ("save device write requests", lambda r: r.get("save_requests"), "{:.0f}"),
    ("save/disk", lambda r: r["save"] / (r["bytes"] / 1e9 / r["fio"]) if r.get("fio") else None, "{:.2f}x"),
    ("save again s", lambda r: r.get("save_again"), "{:.3f}"),
    ("save pruning s", lambda r: r.get("save_prune"), "{:.3f}"),
    ("pruning/again", lambda r: r["save_prune"] / r["save_again"] if r.get("save_prune") else None, "{:.2f}x"),
    ("async stall s", lambda r: r["async_stall"], "{:.4f}"),
    ("stall/save", lambda r: r["async_stall"] / r["save"], "{:.3f}x"),
    ("async total s", lambda r: r["async_total"], "{:.3f}"),
    ("torch.save s", lambda r: r["torch_save"], "{:.3f}"),
    ("DCP save s", lambda r: r["dcp_save"], "{:.3f}"),
    ("DCP stall s", lambda r: r["dcp_stall"], "{:.3f}"),
    ("DCP async total s", lambda r: r["dcp_async_total"], "{:.3f}"),
    ("DS save s", lambda r: r.get("ds_save"), "{:.3f}"),
    ("load s", lambda r: r["load"], "{:.3f}"),
    ("load MB read by rank 0", lambda r: r["load_read"] / 1e6 if "load_read" in r else None, "{:.0f}"),
    ("load broadcasts", lambda r: r.get("load_bcast_calls"), "{:.0f}"),
    ("load broadcast s", lambda r: r.get("load_bcast_s"), "{:.3f}"),
    ("load 1 proc s", lambda r: r["load_1"], "{:.3f}"),
    ("load 1 proc same-size s", lambda r: r.get("load_1_same"), "{:.3f}"),
    ("load 1 proc again s", lambda r: r.get("load_1_again"), "{:.3f}"),
    ("reshard/same", lambda r: r["load_1_again"] / r["load_1_same"] if r.get("load_1_again") else None, "{:.2f}x"),
    ("DCP load s", lambda r: r["dcp_load"], "{:.3f}"),
    ("DS load s", lambda r: r.get("ds_load"), "{:.3f}"),
] + [(f"{what} +RSS MiB", lambda r, k=key: r[k + "_rss"] / 2**20 if k + "_rss" in r else None, "{:.0f}")
     for what, key in (("save", "save"), ("torch.save", "torch_save"),
                       ("DCP save", "dcp_save"), ("DS save", "ds_save"), ("load", "load"),
                       ("DCP load", "dcp_load"), ("DS load", "ds_load"))]


def _summary(rows: list[dict]) -> list[tuple[str, str]]:
    out = []
    for heading, fn, fmt in COLUMNS:
        values = [v for v in (fn(r) for r in rows) if v is not None]
        if not values:
            continue
        med = statistics.median(values)
        out.append((heading, f"{fmt.format(med)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=704)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--dir", default="/tmp/dsrun-ckpt-bench")
    p.add_argument("--deepspeed", default=None, help="directory holding DeepSpeed (pip --target); adds its columns")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if shutil.which("fio") is None:
        print("fio is not installed: no disk column (apt-get install fio)")
    ctx = mp.get_context("spawn")
    stages = [int(s) for s in args.stages.split(",")]
    rows: dict[int, list[dict]] = {s: [] for s in stages}
    for repeat in range(args.repeats):
        for stage in stages:
            row = _pair(ctx, _dsrun_worker, args, stage)
            row.update(_alone(ctx, args, stage))
            if args.deepspeed:
                row.update(_pair(ctx, _deepspeed_worker, args, stage))
            rows[stage].append(row)
            print(f"repeat {repeat} stage {stage}: " + json.dumps({k: round(v, 4) for k, v in row.items()}),
                  flush=True)
            for sub in (f"dsrun{stage}", f"dsrun{stage}-keep", f"deepspeed{stage}"):
                shutil.rmtree(os.path.join(args.dir, sub), ignore_errors=True)
    print(f"\nmedian [min-max] over {args.repeats} repeats, {args.precision}, 2 ranks, {args.dir}")
    for stage in stages:
        print(f"stage {stage}: " + "  ".join(f"{h} {v}" for h, v in _summary(rows[stage])))


if __name__ == "__main__":
    main()

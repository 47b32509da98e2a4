"""Bytes between nodes and step time of compressed communication, on 2 nodes x 2 ranks over SSH.

    .venv/bin/python bench/compression/two_node_step.py [--model small|48m] [--repeats 2]
        [--warmup 3] [--steps 3] [--links free,200mbit]
        [--runs adam,onebitadam,zerooneadam,stage3,stage3-qwz]

Needs root (a network namespace, a veth pair, tc) and installs openssh-server
and iproute2 if missing. Everything it creates is removed on exit, on error
too: the sshd, the namespace, the pair and its qdiscs.

The two nodes (tests/multinode/netns_link.py, [Note: why node-b lives in a
network namespace]): dsrun reaches node-a at 127.0.0.1 and node-b at
127.0.0.2 through a real sshd (tests/multinode/sshd.py), 2 ranks each
(`--hostfile` with 2 slots per node, `--launcher ssh`). node-b's agent and
ranks run in a network namespace joined to node-a by a veth pair, and each
node's ranks bind gloo to their end of it, so every byte between the nodes
crosses the pair and nothing else does. dsrun's shared-memory transport is
off for every collective (the world group spans two nodes: LOCAL_WORLD_SIZE
2, WORLD_SIZE 4); the script checks that the comms logger saw only
torch.distributed (gloo TCP) calls.

Links (`--links`, interleaved with the configurations): `free` (the veth
pair as it is, memory speed) or a rate in tc's syntax (`200mbit`): a token
bucket on both ends of the pair limits each direction to that rate.

Configurations (`--runs`; fp32 compute, lr 1e-4, weight decay 0.01,
gradient_clipping 0; the 48M GPT of bench/step_time/gpt_step.py, or its
5.2M `small` variant):
- adam: "AdamW" (dsrun's native Adam), ZeRO stage 0; gradients all-reduced
  in fp32 (4 bytes per element).
- adam-fp16comm: the same with "communication_data_type": "fp16".
- onebitadam: "OneBitAdam", freeze_step = --warmup: every timed step is
  after warm-up, the momentum exchanged 1-bit compressed.
- zerooneadam: "ZeroOneAdam", var_freeze_step = --warmup - 1,
  local_step_scaler 1, local_step_clipper 4: after warm-up the interval
  between synchronisations doubles every step up to 4 (DeepSpeed's defaults
  keep it at 1 for 32678 steps), so some timed steps send nothing.
- onebitlamb: "OneBitLamb", freeze_step = --warmup.
- stage3: "AdamW" at ZeRO stage 3 (parameters all-gathered in forward,
  gradients reduce-scattered; with --stage3_reuse_distance 0 every unit is
  released after use and gathered again in backward, the ZeRO++ paper's 3
  transfers of the model per step).
- stage3-qwz: + "zero_quantized_weights" (ZeRO++ qwZ: int8 all-gathers).
- stage3-hpz: + "zero_hpz_partition_size": 2 (ZeRO++ hpZ: a secondary
  partition inside each node for the backward all-gather).
- stage3-qgz: + "zero_quantized_gradients" (ZeRO++ qgZ).
- stage3-zpp: qwZ + hpZ + qgZ together.
A configuration whose keys dsrun still rejects (NOT_YET_SUPPORTED in
dsrun/runtime/config.py) is refused before anything starts.

Each launch is one `dsrun` job over SSH running --warmup untimed steps,
then --steps timed ones (forward + backward + step between barriers, the
slowest rank's time). Configurations and links are interleaved (for each
repeat, for each link, every configuration). Reported per link and
configuration: min / median / spread of the step time and its ratio to the
baseline's median on the same link (adam for stage 0 runs, stage3 for stage
3 runs); link MiB per timed step, measured on the veth pair (both
directions, TCP/IP headers and ACKs included, the barriers around each step
too); and the comms logger's bus bytes per rank per step (what each rank
sends, nccl-tests' bus convention; dsrun/runtime/comm/logger.py), total,
inter-node (collectives whose group spans the nodes, counted whole: the
ZeRO++ paper's accounting, an upper bound on what crosses) and per op. The load average before each launch is printed with the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "step_time"))

LR, WEIGHT_DECAY = 1e-4, 0.01
RUNS = ("adam", "adam-fp16comm", "onebitadam", "zerooneadam", "onebitlamb",
        "stage3", "stage3-qwz", "stage3-hpz", "stage3-qgz", "stage3-zpp")
DEFAULT_RUNS = ("adam", "onebitadam", "zerooneadam", "stage3", "stage3-qwz")
ZERO_PP = {"qwz": {"zero_quantized_weights": True}, "hpz": {"zero_hpz_partition_size": 2},
           "qgz": {"zero_quantized_gradients": True}}
ZERO_PP["zpp"] = {**ZERO_PP["qwz"], **ZERO_PP["hpz"], **ZERO_PP["qgz"]}


def config(run: str, micro: int, bucket: int, warmup: int, reuse_distance: int = 10 ** 9) -> dict:
    """The ds_config of configuration `run` (see the module docstring); `reuse_distance`:
    stage3_max_reuse_distance of the stage 3 runs."""
    common = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    stage = 3 if run.startswith("stage3") else 0
    optimizer = {
        "onebitadam": {"type": "OneBitAdam", "params": {**common, "freeze_step": warmup}},
        "zerooneadam": {"type": "ZeroOneAdam", "params": {**common, "var_freeze_step": warmup - 1,
                                                          "local_step_scaler": 1, "local_step_clipper": 4}},
        "onebitlamb": {"type": "OneBitLamb", "params": {**common, "freeze_step": warmup}},
    }.get(run, {"type": "AdamW", "params": common})
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        zero["stage3_max_reuse_distance"] = reuse_distance
    if run.startswith("stage3-"):
        zero.update(ZERO_PP[run.split("-", 1)[1]])
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 0.0, "optimizer": optimizer,
           "zero_optimization": zero, "steps_per_print": 10 ** 9}
    if run == "adam-fp16comm":
        cfg["communication_data_type"] = "fp16"
    return cfg


def not_built(run: str) -> list[str]:
    """The settings of `run` that dsrun still rejects (NOT_YET_SUPPORTED), as key paths."""
    from dsrun.runtime.config import NOT_YET_SUPPORTED

    zero = config(run, 1, 1, 2)["zero_optimization"]
    return [u.path for u in NOT_YET_SUPPORTED
            if u.path.startswith("zero_optimization.") and u.path.split(".", 1)[1] in zero
            and u.applies(zero[u.path.split(".", 1)[1]])]


# ---------------------------------------------------------------- one rank (started by dsrun)

def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    import dsrun
    from gpt_step import GPT, MODELS
    from dsrun.runtime.comm.logger import comms_logger

    torch.set_num_threads(1)
    torch.manual_seed(0)
    s = MODELS[args.model]
    model = GPT(s)
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(),
                                  config=config(args.rank, s.micro, s.bucket, args.warmup, args.stage3_reuse_distance))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, s.vocab, (s.micro, s.seq + 1), generator=g) for _ in range(args.warmup + args.steps)]
    stats = Path("/sys/class/net") / args.iface / "statistics"

    def link_bytes() -> int:  # node-a's end of the pair; node-b's ranks do not see it
        return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text()) if rank == 0 else 0

    times, losses = [], []
    for i, batch in enumerate(data):
        if i == args.warmup:
            dist.barrier()
            comms_logger.reset()
            link0 = link_bytes()
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        dist.barrier()
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    link = link_bytes() - link0
    ops = {op: {"bus_bytes": st.bus_bytes, "inter_node_bus_bytes": st.inter_node_bus_bytes, "bytes": st.bytes,
                "calls": st.calls, "transports": st.transports}
           for op, st in comms_logger.snapshot().items()}
    result = {"rank": rank, "times": times, "losses": losses, "link_bytes": link, "ops": ops,
              "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "world_size": dist.get_world_size()}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------- the head

def launch(run: str, args, cluster, net, wrapper: Path, hosts: Path, work: Path) -> list[dict] | None:
    """One dsrun job over SSH for configuration `run`: each rank's result dict in rank order, or None
    when the job failed (its output is printed).

    Raises:
        SystemExit: a collective between the nodes went through shared memory, or the ranks did not
            see 2 nodes of 2 (the measurement would not be of two nodes).
    """
    out = Path(tempfile.mkdtemp(prefix=f"{run}-", dir=work))
    cmd = [sys.executable, "-m", "dsrun.launcher.cli", "--hostfile", str(hosts),
           "--ssh_config", str(cluster.ssh_config), "--remote_python", str(wrapper), "--master_addr", net.addr_a,
           "--no_local_rank", str(Path(__file__).resolve()), "--rank", run, "--model", args.model,
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", str(out),
           "--stage3_reuse_distance", str(args.stage3_reuse_distance), "--iface", net.iface_a]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    (out / "dsrun.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:  # reported, and the other configurations still run
        print(f"{run}: dsrun exited with {proc.returncode}; its output ends:\n{(proc.stdout + proc.stderr)[-4000:]}",
              file=sys.stderr, flush=True)
        return None
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for res in results:
        used = {t for op in res["ops"].values() for t in op["transports"]}
        if used - {"torch"} or res["local_world_size"] != 2 or res["world_size"] != 4:
            raise SystemExit(f"{run}: rank {res['rank']} saw LOCAL_WORLD_SIZE {res['local_world_size']}, "
                             f"WORLD_SIZE {res['world_size']}, transports {sorted(used)}: the collectives between "
                             "the nodes did not all go through gloo over TCP")
    return results


def summarise(run: str, results: list[dict], steps: int) -> dict:
    step_times = [max(ts) for ts in zip(*(r["times"] for r in results))]
    ops: dict[str, float] = {}
    inter = 0.0
    for r in results:
        for op, st in r["ops"].items():
            ops[op] = ops.get(op, 0.0) + st["bus_bytes"] / steps / len(results)
            inter += st["inter_node_bus_bytes"] / steps / len(results)
    return {"times": step_times, "link": results[0]["link_bytes"] / steps, "bus_ops": ops, "inter": inter,
            "losses": results[0]["losses"]}


def print_tables(model: str, runs: list[str], links: list[str], data: dict, loads: list[float], args) -> None:
    import torch

    from gpt_step import GPT, MODELS

    n = sum(p.numel() for p in GPT(MODELS[model]).parameters())
    print(f"\nGPT {model} ({n / 1e6:.1f}M parameters), 2 nodes x 2 ranks x 1 thread over loopback SSH, fp32; "
          f"{args.repeats} interleaved repeat(s) x {args.steps} timed steps after {args.warmup} warm-up steps; "
          f"stage3_max_reuse_distance {args.stage3_reuse_distance:g}; "
          f"load average before the launches {min(loads):.1f}-{max(loads):.1f} (torch {torch.__version__})")
    for link in links:
        print(f"\nlink {link}{' (each direction)' if link != 'free' else ''}\n")
        print("| run | min s/step | median s/step | spread | vs baseline | link MiB/step (measured) | "
              "bus MiB/step per rank | inter-node bus MiB/step per rank | MiB/step per op |")
        print("|---|---|---|---|---|---|---|---|---|")
        for run in runs:
            d = data[link].get(run)
            if d is None:
                print(f"| {run} | failed (output above) | | | | | | | |")
                continue
            base = "stage3" if run.startswith("stage3") else "adam"
            ts = d["times"]
            med = statistics.median(ts)
            ratio = (f"{med / statistics.median(data[link][base]['times']):.2f}"
                     if base in data[link] else "-")
            bus = sum(d["bus_ops"].values())
            ops = ", ".join(f"{op} {v / 2**20:.2f}" for op, v in sorted(d["bus_ops"].items()) if v >= 1)
            print(f"| {run} | {min(ts):.3f} | {med:.3f} | {(max(ts) - min(ts)) / med:.0%} | {ratio} | "
                  f"{statistics.median(d['link']) / 2**20:.2f} | {bus / 2**20:.2f} | {d['inter'] / 2**20:.2f} | {ops} |")


def head_main(args) -> None:
    from gpt_step import MODELS  # noqa: F401 (fails early on a broken path)
    from tests.multinode.netns_link import node_link, python_wrapper
    from tests.multinode.sshd import loopback_sshd

    runs, links = args.runs.split(","), args.links.split(",")
    for run in runs:
        if run not in RUNS:
            raise SystemExit(f"unknown configuration {run!r}; known: {', '.join(RUNS)}")
        missing = not_built(run)
        if missing:
            raise SystemExit(f"{run}: dsrun does not support {', '.join(missing)} yet "
                             "(NOT_YET_SUPPORTED in dsrun/runtime/config.py); leave it out of --runs")
    if args.warmup < 2:
        raise SystemExit("--warmup must be at least 2 (0/1 Adam freezes its variance at --warmup - 1)")
    data: dict[str, dict[str, dict]] = {link: {} for link in links}
    loads = []
    # SIGTERM (and SIGINT, which a shell's background job ignores) unwind through the `finally`s
    # below, so sshd, the namespace and the qdiscs are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="dsrun-two-node-") as tmp:
        work = Path(tmp)
        hosts = work / "hosts"
        hosts.write_text("node-a slots=2\nnode-b slots=2\n")
        (work / "sshd").mkdir()
        with node_link() as net, loopback_sshd(work / "sshd", extra_addresses=(net.addr_a,)) as cluster:
            wrapper = python_wrapper(work / "python", sys.executable, net)
            for rep in range(args.repeats):
                for link in links:
                    net.set_rate(None if link == "free" else link)
                    for run in runs:
                        loads.append(os.getloadavg()[0])
                        results = launch(run, args, cluster, net, wrapper, hosts, work)
                        if results is None:
                            continue
                        s = summarise(run, results, args.steps)
                        d = data[link].setdefault(run, {"times": [], "link": [], "bus_ops": s["bus_ops"],
                                                        "inter": s["inter"]})
                        d["times"] += s["times"]
                        d["link"].append(s["link"])
                        print(f"[repeat {rep + 1}/{args.repeats}] link {link} {run}: median "
                              f"{statistics.median(s['times']):.3f} s/step, link {s['link'] / 2**20:.2f} MiB/step, "
                              f"bus {sum(s['bus_ops'].values()) / 2**20:.2f} MiB/step/rank, load {loads[-1]:.1f}, "
                              f"losses {' '.join(f'{x:.4f}' for x in s['losses'])}", file=sys.stderr, flush=True)
    print_tables(args.model, runs, links, data, loads, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("small", "48m"), default="small")
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated, of: {', '.join(RUNS)}")
    ap.add_argument("--links", default="free,200mbit",
                    help="comma-separated: free, or a per-direction rate in tc's syntax (e.g. 200mbit)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stage3_reuse_distance", type=int, default=10 ** 9,
                    help="stage3_max_reuse_distance of the stage 3 runs; dsrun's default 1e9 keeps every unit "
                         "gathered from forward to backward when it fits, 0 releases each after use so backward "
                         "gathers again (the regime ZeRO++ and hpZ are for)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take")
    ap.add_argument("--rank", help=argparse.SUPPRESS)  # set by the head for the ranks it launches
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--iface", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rank_main(args) if args.rank else head_main(args)


if __name__ == "__main__":
    main()

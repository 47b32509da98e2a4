"""A small data-parallel training run with gloo, for launcher tests.

Each rank trains the same linear model on its shard of a fixed global batch,
averages gradients with all_reduce and steps SGD; rank 0 prints the global
loss per step as `LOSS <step> <value>`. Every rank prints one `WHERE` line
(rank, the sshd address or Slurm node it was started through, whether the secret variable
arrived, whether any process command line on this machine shows it).

    --mode train        train and exit 0
    --mode sleep        write PIDDIR/rank_N.pid and sleep (the test kills one rank)
    --mode fail         rank --fail_rank raises after --steps steps; the others wait in all_reduce
"""
import argparse
import hashlib
import os
import sys
import time

import psutil
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mode", default="train", choices=["train", "sleep", "fail"])
p.add_argument("--steps", type=int, default=5)
p.add_argument("--fail_rank", type=int, default=-1)
p.add_argument("--piddir", default="")
p.add_argument("--secret_var", default="HF_TOKEN")
p.add_argument("--dsrun_init", action="store_true", help="join the group with dsrun.init_distributed()")
p.add_argument("--distributed_port", type=int, default=29500, help="with --dsrun_init: MASTER_PORT if unset")
p.add_argument("--local_rank", type=int, default=-1)  # appended by the launcher, as DeepSpeed's does
args = p.parse_args()
if args.dsrun_init:  # e.g. under srun with one task per rank: dsrun finds the rank in SLURM_* variables
    import dsrun
    dsrun.init_distributed(dist_backend="gloo", distributed_port=args.distributed_port)

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
secret = os.environ.get(args.secret_var, "")
shown = any(secret and secret in " ".join(proc.info["cmdline"] or [])
            for proc in psutil.process_iter(["cmdline"]))
print(f"WHERE rank={rank} local_rank={os.environ['LOCAL_RANK']} node_rank={os.environ.get('NODE_RANK', '-')} "
      f"via={(os.environ.get('SSH_CONNECTION') or '- - local').split()[2]} "
      f"slurm_node={os.environ.get('SLURMD_NODENAME', '-')} "
      f"secret_sha={hashlib.sha256(secret.encode()).hexdigest()[:12]} secret_in_cmdline={shown}", flush=True)

if args.mode == "sleep":
    with open(os.path.join(args.piddir, f"rank_{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
    sys.exit(0)

if not dist.is_initialized():
    dist.init_process_group("gloo")
g = torch.Generator().manual_seed(0)
global_x = torch.randn(8 * args.steps, 16, generator=g)
global_y = global_x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(8 * args.steps, 1, generator=g)
model = torch.nn.Linear(16, 1)
torch.nn.init.zeros_(model.weight)
torch.nn.init.zeros_(model.bias)
# Plain SGD at lr 0.1 by hand: torch.optim.SGD's step would import torch._dynamo
# (about 1 CPU-second a rank); conftest.expected_losses uses torch.optim.SGD.
params = list(model.parameters())
per_rank = 8 // world
for step in range(args.steps):
    if args.mode == "fail" and rank == args.fail_rank and step == args.steps - 1:
        # The group goes first ([Note: leaving gloo] below: exit 134 instead of 1 was seen once in CI);
        # the tests read the traceback and exit status of the raise.
        dist.destroy_process_group()
        raise RuntimeError(f"injected failure on rank {rank}")
    lo = step * 8 + rank * per_rank
    x, y = global_x[lo:lo + per_rank], global_y[lo:lo + per_rank]
    loss = torch.nn.functional.mse_loss(model(x), y)
    for param in params:
        param.grad = None
    loss.backward()
    with torch.no_grad():
        for param in params:
            dist.all_reduce(param.grad)
            param.grad /= world
            param.add_(param.grad, alpha=-0.1)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        print(f"LOSS {step} {total.item() / world:.8f}", flush=True)
if args.mode == "fail":
    time.sleep(120)  # never reached by the healthy ranks: they block in all_reduce above
# [Note: leaving gloo] With torch 2.13, a rank whose interpreter exits while
# gloo objects are alive, or while a peer is still tearing down, sometimes
# aborts in native code ("terminate called without an active exception",
# SIGABRT) although training finished. So: leave together, destroy the group,
# and skip the interpreter's own teardown.
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
if "mpi4py.MPI" in sys.modules:  # dsrun found rank 0 over MPI: mpirun fails a rank that skips MPI_Finalize
    sys.modules["mpi4py.MPI"].Finalize()
os._exit(0)

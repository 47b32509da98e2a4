"""Ray Train's DeepSpeed pattern on dsrun: `deepspeed.initialize` inside a `TorchTrainer` worker.

Ray starts the workers and creates the torch.distributed process group
itself (gloo here, NCCL with GPUs); dsrun adopts that group instead of
making its own. The only change to a DeepSpeed script is the import.

    pip install "ray[train]"
    python examples/ray_train.py --workers 2            # rank 0 prints LOSSES [...] through Ray
    python examples/ray_train.py --reference            # the same steps in one process

Both print the same losses (the global batch is split over the workers;
the engine averages gradients over them). tests/compat/test_ray_train.py
runs this and compares.
"""
import argparse
import json

import torch

import dsrun as deepspeed
import dsrun.comm as dist

GLOBAL_BATCH = 8


def train_loop(config: dict) -> list[float]:
    """A few SGD steps of a linear model on a fixed data set; returns the loss per step, averaged over ranks."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    steps = config["steps"]
    x = torch.randn(GLOBAL_BATCH * steps, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(GLOBAL_BATCH * steps, 1, generator=g)
    model = torch.nn.Linear(16, 1)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    deepspeed.init_distributed(dist_backend="gloo")  # under Ray: describes the group Ray made
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": per_rank})
    losses = []
    for step in range(steps):
        lo = step * GLOBAL_BATCH + rank * per_rank
        loss = torch.nn.functional.mse_loss(engine(x[lo:lo + per_rank]), y[lo:lo + per_rank])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _ray_worker(config: dict) -> None:
    losses = train_loop(config)
    if dist.get_rank() == 0:  # Ray forwards a worker's output to the driver's, prefixed with its name
        print(f"ranks={dist.get_world_size()} LOSSES " + json.dumps(losses), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--storage", default=None, help="Ray Train's storage_path [default: ~/ray_results]")
    p.add_argument("--reference", action="store_true", help="run the steps in this process, without Ray")
    args = p.parse_args()
    if args.reference:
        print("LOSSES " + json.dumps(train_loop({"steps": args.steps})), flush=True)
        return
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=args.workers, include_dashboard=False)
    trainer = TorchTrainer(_ray_worker, train_loop_config={"steps": args.steps},
                           torch_config=TorchConfig(backend="gloo"),
                           scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
                           run_config=RunConfig(storage_path=args.storage))
    trainer.fit()  # raises ray.train.TrainingFailedError if a worker failed


if __name__ == "__main__":
    main()

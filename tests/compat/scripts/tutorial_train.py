"""A training script written as DeepSpeed's getting-started tutorial and CIFAR-10
example write theirs, with `import dsrun as deepspeed` as the only change:
--local_rank from the launcher, add_config_arguments, get_accelerator(),
deepspeed.comm, the engine's data loader, RepeatingLoader, log_dist,
see_memory_usage, the engine's precision queries and save_checkpoint.

Prints one line "RESULT {json}" per rank.
"""
import argparse
import json

import torch
import torch.nn as nn

import dsrun as deepspeed
import dsrun.comm as dist
from dsrun.accelerator import get_accelerator
from dsrun.runtime.utils import see_memory_usage
from dsrun.utils import RepeatingLoader, log_dist


def get_args():
    parser = argparse.ArgumentParser(description="tiny classifier")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save_dir", default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.layers(x)


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    torch.manual_seed(1234)
    features = torch.randn(256, 16)
    labels = (features[:, :4].argmax(dim=1)).long()  # learnable: the largest of the first 4 inputs
    trainset = torch.utils.data.TensorDataset(features, labels)

    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    micro_steps = args.steps * model_engine.gradient_accumulation_steps()
    for i, (inputs, targets) in enumerate(RepeatingLoader(trainloader)):
        inputs, targets = inputs.to(local_device), targets.to(local_device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        loss = criterion(model_engine(inputs).float(), targets)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
        if i + 1 == micro_steps:
            break

    last = torch.tensor([sum(losses[-4:]) / 4], device=local_device)
    dist.all_reduce(last)
    last /= dist.get_world_size()
    log_dist(f"mean loss over ranks: {last.item():.4f}", ranks=[0])
    see_memory_usage("after training", force=True)
    if args.save_dir:
        model_engine.save_checkpoint(args.save_dir, client_state={"micro_steps": micro_steps})
    print("RESULT " + json.dumps({
        "rank": dist.get_rank(), "local_rank_arg": args.local_rank, "world": dist.get_world_size(),
        "first": sum(losses[:4]) / 4, "last_mean": last.item(), "stage": model_engine.zero_optimization_stage(),
        "bf16": model_engine.bfloat16_enabled(), "global_steps": model_engine.global_steps,
        "optimizer": type(optimizer).__name__, "lr": model_engine.get_lr()[0],
        "config_stage": model_engine.config.get("zero_optimization", {}).get("stage")}), flush=True)


if __name__ == "__main__":
    main()

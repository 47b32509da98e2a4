"""DeepSpeedExamples' CIFAR-10 script (training/cifar/cifar10_deepspeed.py) in
its --moe shape, with the import lines changed to dsrun and synthetic images
instead of the torchvision download: deepspeed.init_distributed(), the
LeNet with a list of `deepspeed.moe.layer.MoE(hidden_size=84,
expert=nn.Linear(84, 84), num_experts=n, ep_size=..., use_residual=...,
k=1, min_capacity=..., noisy_gate_policy="RSample")` layers called as
`x, _, _ = layer(x)` (the auxiliary loss thrown away, as the example does),
parameters through `split_params_into_different_moe_groups_for_optimizer(
{"params": ..., "name": "parameters"})`, and initialize(training_data=...).

--capacity-factor, --no-rts (use_rts=False) and --images are ours, for the
comparison with DeepSpeed's losses over capacity.

Prints one line "RESULT {json}" per rank.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import dsrun as deepspeed
from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1],
                        help="number of experts list, MoE related.")
    parser.add_argument("--mlp-type", type=str, default="standard",
                        help="Only applicable when num-experts > 1, accepts [standard, residual]")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int,
                        help="(moe) minimum capacity of an expert regardless of the capacity_factor")
    parser.add_argument("--noisy-gate-policy", default=None, type=str,
                        help="(moe) noisy gating (only supported with top-1). Valid values are None, RSample, Jitter")
    parser.add_argument("--capacity-factor", default=1.0, type=float, help="(moe) capacity factor in training")
    parser.add_argument("--no-rts", default=False, action="store_true",
                        help="(moe) no random token selection: keep torch.topk of the choice mask")
    parser.add_argument("--images", default=64, type=int, help="synthetic training images")
    parser.add_argument("--moe-param-group", default=False, action="store_true",
                        help="(moe) create separate moe param groups, required when using ZeRO w. MoE")
    parser.add_argument("--stage", default=0, type=int, help="ZeRO stage")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"])
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


args = add_argument()
deepspeed.init_distributed()


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        if args.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(hidden_size=84, expert=fc3, num_experts=n_e, ep_size=args.ep_world_size,
                                            use_residual=args.mlp_type == "residual", k=args.top_k,
                                            min_capacity=args.min_capacity, noisy_gate_policy=args.noisy_gate_policy,
                                            capacity_factor=args.capacity_factor, use_rts=not args.no_rts))
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if args.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def create_moe_param_groups(model):
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


torch.manual_seed(0)
net = Net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
if args.moe_param_group:
    parameters = create_moe_param_groups(net)

gen = torch.Generator().manual_seed(1)
images = torch.randn(args.images, 3, 32, 32, generator=gen)
labels = (images[:, 0].mean(dim=(1, 2)) > 0).long() + 2 * (images[:, 1].mean(dim=(1, 2)) > 0).long()
trainset = torch.utils.data.TensorDataset(images, labels)

ds_config = {
    "train_batch_size": 16,
    "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "bf16": {"enabled": args.dtype == "bf16"},
    "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
             "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                          "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
}

model_engine, optimizer, trainloader, __ = deepspeed.initialize(
    args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)

local_device = model_engine.device
local_rank = model_engine.local_rank
target_dtype = None
if model_engine.bfloat16_enabled():
    target_dtype = torch.bfloat16
elif model_engine.fp16_enabled():
    target_dtype = torch.half

criterion = nn.CrossEntropyLoss()
losses = []
for epoch in range(args.epochs):
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(local_device), data[1].to(local_device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())

print("RESULT " + json.dumps({"rank": model_engine.global_rank, "steps": model_engine.global_steps,
                              "losses": losses, "groups": len(optimizer.param_groups)}), flush=True)

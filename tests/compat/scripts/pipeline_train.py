"""A pipeline-parallel training script in the shape of DeepSpeedExamples'
training/pipeline_parallelism/train.py, with `import dsrun as deepspeed`
(and dsrun's module paths in the other import lines) as the only change: a
small AlexNet-style net flattened into a list of layers, PipelineModule,
`initialize(training_data=...)` and `engine.train_batch()` per step.

The data is synthetic: 3x16x16 images whose label is the argmax of a fixed
class pattern plus noise, so the loss can fall. Rank 0 prints
"step N loss X" per step.
"""
import argparse
import os

import torch
import torch.nn as nn

import dsrun as deepspeed
from dsrun.pipe import PipelineModule


class SyntheticImages(torch.utils.data.Dataset):
    """`size` 3x16x16 fp32 images with int64 labels in [0, classes): each
    image is its label's fixed random pattern plus unit
    Gaussian noise. The same seed gives the same dataset on every rank."""

    def __init__(self, size=512, classes=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        patterns = torch.randn(classes, 3, 16, 16, generator=g)
        self.labels = torch.randint(0, classes, (size,), generator=g)
        self.images = patterns[self.labels] + torch.randn(size, 3, 16, 16, generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


class TinyAlexNet(nn.Module):
    """AlexNet's layout (features, then classifier) at toy size, for 3x16x16 inputs."""

    def __init__(self, num_classes=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Linear(16 * 4 * 4, 64), nn.ReLU(inplace=True), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def get_args():
    parser = argparse.ArgumentParser(description="synthetic images, pipeline parallel")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=20, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers(vision_model):
    return [
        *vision_model.features,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)

    net = TinyAlexNet(num_classes=4)
    net = PipelineModule(layers=join_layers(net),
                         loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size,
                         partition_method=part,
                         activation_checkpoint_interval=0)

    trainset = SyntheticImages()

    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)

    for step in range(args.steps):
        loss = engine.train_batch()
        if torch.distributed.get_rank() == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    args = get_args()

    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)

    train_pipe(args)

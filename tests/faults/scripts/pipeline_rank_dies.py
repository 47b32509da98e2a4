"""Rank script: a 2-stage pipeline trained with `engine.train_batch()` where
rank 1 dies inside step 2's schedule, from a layer's forward.

argv: MODE DEATH_FILE, MODE "exit" (os._exit(1)) or "sigkill" (SIGKILL to
itself, as the OOM killer would). Before dying rank 1 writes time.time() to
DEATH_FILE so the test can time the job's end from the death. Every rank
prints "step N done" after each train_batch.
"""
import os
import signal
import sys
import time

import torch

import dsrun
from dsrun.pipe import LayerSpec, PipelineModule

MICRO_BATCHES = 4
args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
mode, death_file = args


class DiesInStepTwo(torch.nn.Module):
    """Identity that ends its process (on rank 1) at the second forward of step 2."""

    calls = 0

    def forward(self, x):
        DiesInStepTwo.calls += 1
        if os.environ["RANK"] == "1" and DiesInStepTwo.calls == MICRO_BATCHES + 2:
            with open(death_file, "w") as f:
                f.write(repr(time.time()))
            if mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)
        return x


dsrun.init_distributed()
torch.manual_seed(0)
layers = [LayerSpec(torch.nn.Linear, 8, 8), LayerSpec(DiesInStepTwo), torch.nn.Tanh(),
          LayerSpec(torch.nn.Linear, 8, 8), LayerSpec(DiesInStepTwo), LayerSpec(torch.nn.Linear, 8, 3)]
module = PipelineModule(layers, num_stages=2, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform")
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
engine, *_ = dsrun.initialize(model=module, training_data=data, config={
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": MICRO_BATCHES,
    "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
for step in range(1, 4):
    engine.train_batch()
    print(f"step {step} done", flush=True)

"""Run by tests/install/test_plain_install.py under `dsrun --num_procs 2` in a
venv without NumPy: save a ZeRO-2 checkpoint, change the weights, load it back."""
import sys

import torch

import dsrun

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
engine, *_ = dsrun.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2),
                              config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
engine.backward(engine(torch.randn(2, 8)).square().mean())
engine.step()
saved = {n: engine.strategy.full_fp32_param(p).clone() for n, p in net.named_parameters()}
engine.save_checkpoint(sys.argv[1])
engine.backward(engine(torch.randn(2, 8)).square().mean())
engine.step()
engine.load_checkpoint(sys.argv[1])
loaded = {n: engine.strategy.full_fp32_param(p) for n, p in net.named_parameters()}
assert all(torch.equal(saved[n], loaded[n]) for n in saved)
print("CHECKPOINT OK", flush=True)

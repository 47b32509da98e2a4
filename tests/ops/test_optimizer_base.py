"""An eager run does not import torch._dynamo (dsrun's optimizers, a pipeline's
parameter count on the meta device); once it is imported, the optimizers call
torch's wrapper. See [Note: torch._dynamo on the eager path] (dsrun/ops/optimizer_base.py).
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dsrun.ops.adam import DeepSpeedCPUAdam, FusedAdam
from dsrun.ops.lamb import FusedLamb
from dsrun.ops.lion import Lion

ROOT = Path(__file__).resolve().parents[2]

# One process-wide eager run: a one-rank engine with dsrun's AdamW trains, saves
# and loads a checkpoint; Lion and FusedLamb add groups, step, zero and reload; a
# PipelineModule counts an embedding's and a normal_-initialised layer's parameters
# on the meta device ("parameters" partitioning) and builds them for real.
EAGER_RUN = textwrap.dedent("""
    import sys
    import torch
    import dsrun
    from dsrun.ops.lamb import FusedLamb
    from dsrun.ops.lion import Lion

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    engine, *_ = dsrun.initialize(model=net, model_parameters=net.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
    engine.save_checkpoint(sys.argv[1], tag="t")
    engine.load_checkpoint(sys.argv[1], tag="t")
    for cls in (Lion, FusedLamb):
        a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
        opt = cls(a.parameters(), lr=0.01)
        opt.add_param_group({"params": b.parameters()})
        b(a(torch.randn(2, 3))).sum().backward()
        opt.step()
        opt.zero_grad()
        opt.load_state_dict(opt.state_dict())
    from dsrun.pipe import LayerSpec, PipelineModule

    class Normal(torch.nn.Linear):
        def reset_parameters(self):
            torch.nn.init.normal_(self.weight, std=0.02)
            self.bias.data.normal_()

    pipe = PipelineModule([LayerSpec(torch.nn.Embedding, 11, 6), LayerSpec(Normal, 6, 3)], num_stages=1,
                          partition_method="parameters")
    assert pipe.parts == [0, 2], pipe.parts
    assert sum(p.numel() for p in pipe.parameters()) == 11 * 6 + 6 * 3 + 3
    assert all(p.device.type == "cpu" and float(p.std()) > 0 for p in pipe.parameters())
    print(type(engine.optimizer).__name__, "torch._dynamo" in sys.modules)
""")


@pytest.mark.slow
def test_an_eager_run_never_imports_dynamo(tmp_path):
    proc = subprocess.run([sys.executable, "-c", EAGER_RUN, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split()[-2:] == ["DeepSpeedCPUAdam", "False"], proc.stdout + proc.stderr


@pytest.mark.parametrize("cls", [DeepSpeedCPUAdam, Lion, FusedLamb])
def test_with_dynamo_imported_every_wrapped_method_goes_through_torchs_wrapper(cls):
    import torch._dynamo  # noqa: F401  (what torch.compile or engine.compile() does first)

    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    opt = cls(a.parameters(), lr=0.01)
    wrapped = {name: getattr(torch.optim.Optimizer, name).__wrapped__
               for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict")}
    for fn in wrapped.values():  # torch's wrapper caches its disabled function here on each call's first
        if hasattr(fn, "__dynamo_disable"):
            delattr(fn, "__dynamo_disable")
    opt.add_param_group({"params": b.parameters()})
    b(a(torch.randn(2, 3))).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    assert [name for name, fn in wrapped.items() if not hasattr(fn, "__dynamo_disable")] == []
    assert all(p.grad is None for p in [*a.parameters(), *b.parameters()])
    assert len(opt.param_groups) == 2 and len(opt.state) == 4


@pytest.mark.parametrize("cls", [DeepSpeedCPUAdam, FusedAdam, Lion, FusedLamb])
def test_step_runs_the_closure_with_autograd_and_returns_its_loss(cls):
    torch.manual_seed(0)
    net, x = torch.nn.Linear(3, 1), torch.randn(4, 3)
    before = [p.detach().clone() for p in net.parameters()]
    opt = cls(net.parameters(), lr=0.1)

    def closure():
        opt.zero_grad()
        loss = net(x).square().mean()
        loss.backward()  # fails unless step() re-enables autograd around the closure
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert all(not torch.equal(a, p) for a, p in zip(before, net.parameters()))
    assert opt.step() is None

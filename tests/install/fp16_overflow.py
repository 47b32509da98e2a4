"""Run by tests/install/test_plain_install.py under `dsrun --num_procs 2` in a
venv holding dsrun's install requirements only (no NumPy).

For ZeRO stages 0, 2 and 3: fp16 with an inf injected into one gradient on
rank 1 at the first step only. The first step must be skipped on every rank
(parameters unchanged, loss scale halved, the parameter named), the second
applied. Prints one `RESULT stage=S ...` line per stage on rank 0.
"""
import importlib.util

import torch

import dsrun
from dsrun.runtime import comm

assert importlib.util.find_spec("numpy") is None, "NumPy is importable: not a plain install"

TARGET = "1.weight"


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def snapshot(engine):
    return {n: engine.strategy.full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def run(stage):
    net = model()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = dsrun.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), config=cfg)
    target = dict(net.named_parameters())[TARGET]
    poison = [comm.get_rank() == 1]  # rank 1 only, first step only

    def hook(grad):
        if poison[0]:
            poison[0] = False
            return grad * float("inf")
        return grad

    target.register_hook(hook)
    gen = torch.Generator().manual_seed(comm.get_rank())
    steps = []
    for _ in range(2):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        before = snapshot(engine)
        scale = engine.strategy.precision.scaler.scale
        loss = torch.nn.functional.mse_loss(engine(x.half()).float(), y)
        engine.backward(loss)
        engine.step()
        after = snapshot(engine)
        steps.append({"applied": engine.was_step_applied(), "skipped": engine.skipped_steps,
                      "scale_before": scale, "scale_after": engine.strategy.precision.scaler.scale,
                      "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                      "finite": all(bool(torch.isfinite(t).all()) for t in after.values()),
                      "named": engine.strategy.last_overflow_param})
    first, second = steps
    assert first["applied"] is False and first["skipped"] == 1, first
    assert first["unchanged"] and first["finite"], first
    assert first["scale_after"] == first["scale_before"] / 2 == 2.0 ** 9, first
    assert first["named"] == TARGET, first
    assert second["applied"] is True and second["skipped"] == 1, second
    assert not second["unchanged"] and second["finite"], second
    assert second["scale_after"] == 2.0 ** 9, second
    if comm.get_rank() == 0:
        print(f"RESULT stage={stage} skipped={first['skipped']} scale={first['scale_before']:g}->"
              f"{first['scale_after']:g} named={first['named']} second_applied={second['applied']}", flush=True)


for stage in (0, 2, 3):
    run(stage)
comm.barrier()

"""ZeRO stage 3 and optimizer offload with a pipeline, on 4 gloo ranks
(pipe 2 x data 2): the losses, clipped global gradient norms and weights
equal one process training the same layers on the same global batch (fp32,
to 1e-5). Stage 3 partitions each stage's parameters over that stage's
data group and gathers one layer at a time inside the schedule's actions.
DeepSpeed refuses stage 3 with a pipeline (DeepSpeed issue #1629)."""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_pipe_engine import STEPS, _check, _config, _layers, _micro_batch, _train_reference

STAGES, MICRO_BATCHES = 2, 4


def _train(schedule: str, virtual: int, zero: dict, optimizer: dict | None = None) -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    module = PipelineModule(_layers(), num_stages=STAGES, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform", virtual_stages=virtual)
    cfg = _config(STAGES, 2, MICRO_BATCHES, schedule, 0, False, virtual)
    cfg["zero_optimization"] = zero
    cfg["optimizer"] = optimizer or cfg["optimizer"]
    engine, *_ = dsrun.initialize(model=module, config=cfg)
    data_rank = engine.grid.get_data_parallel_rank()
    losses, norms, gathered = [], [], []
    for step in range(STEPS):
        batches = iter([_micro_batch(step, data_rank, j) for j in range(MICRO_BATCHES)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(engine.get_global_grad_norm())
        gathered.append(engine.strategy.gathered_numel() if zero["stage"] == 3 else 0)
    held = {name: p.numel() for name, p in module.named_parameters()}  # what the rank holds between steps
    weights = {name: dsrun.zero.safe_get_full_fp32_param(p).clone() for name, p in module.named_parameters()}
    units = [u.name for u in engine.strategy.units] if zero["stage"] == 3 else []
    shard = engine.strategy.groups.shard.size
    return {"losses": losses, "norms": norms, "weights": weights, "held": held, "units": units,
            "gathered": gathered, "shard": shard, "full": {n: w.numel() for n, w in weights.items()},
            "swap_bytes": engine.strategy.optimizer_tier.nvme_bytes()}


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2)])
def test_zero3_with_a_pipeline_matches_one_process(schedule, virtual):
    """Each stage's layers are partitioned over its 2 data ranks (each layer
    its own gather unit, nothing left gathered between steps), and training
    equals one process's."""
    results = run_ranks(_train, 4, schedule, virtual, {"stage": 3, "stage3_param_persistence_threshold": 0})
    _check(results, _train_reference(2, MICRO_BATCHES, False), rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["shard"] == 2, "ZeRO's group is the stage's data group, not the world"
        assert all(held == 0 for held in r["held"].values()), "parameters stay partitioned between steps"
        assert r["gathered"] == [0] * STEPS
        layers = {name.split(".")[0] for name in r["full"]}
        assert set(r["units"]) == layers, "one gather unit per layer of the stage (the root holds none)"


def test_zero3_with_the_zero_bubble_schedule_is_refused_at_initialize():
    """Every rank raises the ConfigError before any collective."""
    from dsrun.runtime.config import ConfigError
    results = run_ranks(_refused, 2, "zb-h1", {"stage": 3})
    assert all(ConfigError.__name__ in r and "zb-h1" in r for r in results), results


def _refused(schedule: str, zero: dict) -> str:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    module = PipelineModule(_layers(), num_stages=2, loss_fn=F.cross_entropy, partition_method="uniform")
    cfg = _config(2, 1, 2, schedule, 0, False, 1)
    cfg["zero_optimization"] = zero
    try:
        dsrun.initialize(model=module, config=cfg)
    except Exception as exc:  # noqa: BLE001 -- the test checks its type by name (pickled across processes)
        return f"{type(exc).__name__}: {exc}"
    return "trained"


@pytest.mark.parametrize("stage,device", [(2, "cpu"), (3, "nvme")])
def test_optimizer_offload_with_a_pipeline_matches_one_process(stage, device, tmp_path):
    """The Adam states and fp32 masters of each stage in host memory (cpu,
    stepped by dsrun's CPU Adam) or in swap files (nvme); equal to torch's
    Adam in one process."""
    offload = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=str(tmp_path), buffer_count=3)
    adam = {"type": "Adam", "params": {"lr": 0.01}}
    results = run_ranks(_train, 4, "1f1b", 1, {"stage": stage, "offload_optimizer": offload}, adam)
    reference = _train_reference(2, MICRO_BATCHES, False, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    _check(results, reference, rtol=1e-5, atol=1e-6)
    assert all((r["swap_bytes"] > 0) == (device == "nvme") for r in results), "the moments live in swap files"


def _train_tied_host_copies(micro_batches: int) -> dict:
    """Weights tied across the stages, ZeRO-2 with the optimizer offloaded
    through the host-copy path (a CUDA model's: `cpu:0` stands for host
    memory, see tests/offload/test_offload_devices.py)."""
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    from tests.offload.test_offload_devices import _patch_tiers
    from tests.parallel.test_pipe_engine import _tied_layers
    init_distributed()
    _patch_tiers(torch.device("cpu", 0), "cpu")
    module = PipelineModule(_tied_layers(), num_stages=2, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform")
    cfg = _config(2, 2, micro_batches, "1f1b", 2, False, 1)
    cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    cfg["zero_force_ds_cpu_optimizer"] = False  # torch's SGD steps the host masters, as in the reference
    engine, *_ = dsrun.initialize(model=module, config=cfg)
    data_rank = engine.grid.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter([_micro_batch(step, data_rank, j)
                                                     for j in range(micro_batches)]))))
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "host_copies": engine.strategy.optimizer_tier.host_grads is not None}


def test_offload_host_copies_with_tied_weights():
    """The tied weight's gradient is summed over the stages after backward
    wrote it to host memory; the norm, summed on the device from the copies
    when one micro-batch wrote them, must see the sum (it did not: 0.763
    against 0.789)."""
    import torch.nn.functional as F

    from tests.parallel.test_pipe_engine import _TiedReference
    micro_batches = 1
    results = run_ranks(_train_tied_host_copies, 4, micro_batches)
    model = _TiedReference()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for d in range(2):
            for j in range(micro_batches):
                x, y = _micro_batch(step, d, j)
                loss = F.cross_entropy(model(x), y) / (2 * micro_batches)
                loss.backward()
                total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(total)
    for r in results:
        assert r["host_copies"], "the gradients went through the host-copy path"
        assert r["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        assert r["norms"] == pytest.approx(norms, rel=1e-5, abs=1e-6)

"""Mixture of Experts inside a pipeline, its auxiliary loss riding along:
each stage passes (hidden states, running auxiliary loss), as DeepSpeed's
pipeline models do, and the last stage's loss function adds the auxiliary
loss. pipe 2 x data 2 on 4 gloo ranks, an MoE layer on each stage with its
4 experts at ep_size 2 (over the stage's 2 data ranks), against one process
training the same layers (all experts local) on the same global batch:
losses and clipped global gradient norms to 1e-5 (fp32). Also a pipeline
whose only MoE layer is on stage 1, built from `num_stages` as a DeepSpeed
script does: its expert groups involve stage 1's ranks only (mesh.py
[Note: groups of some ranks only]), so nothing hangs."""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_moe_mesh import _distinct_experts

H, SEQ, MICRO, MICRO_BATCHES, DATA, STEPS, EXPERTS, AUX = 8, 3, 2, 2, 2, 3, 4, 0.1


class _Start(torch.nn.Module):
    """x -> (linear(x), a zero auxiliary loss to add to)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(H, H)

    def forward(self, x):
        return torch.tanh(self.linear(x)), x.new_zeros(())


class _MoEBlock(torch.nn.Module):
    """(h, aux) -> (h + MoE(h), aux + the layer's l_aux)."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        from dsrun.moe.layer import MoE
        self.moe = MoE(H, torch.nn.Linear(H, H), num_experts=EXPERTS, ep_size=ep, k=1, capacity_factor=1.0,
                       min_capacity=1, use_rts=False)

    def forward(self, inputs):
        h, aux = inputs
        out, l_aux, _ = self.moe(h)
        return h + out, aux + l_aux


class _DenseBlock(torch.nn.Module):
    """(h, aux) -> (h + tanh(linear(h)), aux): a block without experts."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(H, H)

    def forward(self, inputs):
        h, aux = inputs
        return h + torch.tanh(self.linear(h)), aux


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(H, H)

    def forward(self, inputs):
        h, aux = inputs
        return self.linear(h), aux


def _loss(outputs, labels):
    """The task's loss plus the auxiliary loss carried from every MoE layer."""
    prediction, aux = outputs
    return torch.nn.functional.mse_loss(prediction, labels) + AUX * aux


def _layers(ep: int, moe_on_last_stage_only: bool = False):
    """4 layers, 2 per stage; an MoE block on each stage, or (moe_on_last_stage_only)
    a dense block on stage 0 and the MoE block on stage 1."""
    from dsrun.pipe import LayerSpec
    first = LayerSpec(_DenseBlock) if moe_on_last_stage_only else LayerSpec(_MoEBlock, ep)
    return [LayerSpec(_Start), first, LayerSpec(_MoEBlock, ep), LayerSpec(_Head)]


def _micro_batch(step: int, data_rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 100 * data_rank + micro)
    return torch.randn(MICRO, SEQ, H, generator=g), torch.randn(MICRO, SEQ, H, generator=g)


def _config(zero_stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICRO_BATCHES,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "gradient_clipping": 0.3,
            "zero_optimization": {"stage": zero_stage}, "steps_per_print": 1000}


def _train_pipeline(zero_stage: int, mesh_first: bool, moe_on_last_stage_only: bool = False) -> dict:
    """`mesh_first`: build the pipe x data mesh before the layers (as for 3D,
    docs/pipeline.md); else as a DeepSpeed script does, num_stages only (the
    MoE layers are built on the all-data mesh, initialize makes the pipeline's).
    `moe_on_last_stage_only`: see _layers; the experts stay the copies MoE
    makes (_distinct_experts would ask for the expert groups on the all-data
    mesh, whose expert-data groups cross the stages, before initialize)."""
    import torch.distributed as dist

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    dsrun.init_distributed()
    place = {"num_stages": 2}
    if mesh_first:
        mesh = ParallelMesh.build(dist.get_world_size(), pipe=2)
        set_current(mesh)
        place = {"topology": mesh.topology}
    module = PipelineModule(_layers(2, moe_on_last_stage_only), loss_fn=_loss, partition_method="uniform",
                            seed_layers=True, **place)
    if not moe_on_last_stage_only:
        _distinct_experts(module)
    engine, *_ = dsrun.initialize(model=module, config=_config(zero_stage))
    moe = [m for m in module.modules() if type(m).__name__ == "MOELayer"]
    losses, norms, aux_reached = [], [], []
    for step in range(STEPS):
        batches = iter([_micro_batch(step, engine.grid.get_data_parallel_rank(), j) for j in range(MICRO_BATCHES)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(engine.get_global_grad_norm())
        aux_reached.append([not m.load.aux_pending for m in moe])
    return {"losses": losses, "norms": norms, "stage": engine.stage_id, "aux_reached": aux_reached,
            "local_experts": [m.num_local_experts for m in moe]}


def _train_reference(moe_on_last_stage_only: bool = False) -> dict:
    """One process: the same layers (all 4 experts local) in order, the
    global batch's micro-batches one forward each, as the data ranks run them."""
    from dsrun.runtime.utils import set_random_seed
    layers = []
    for idx, spec in enumerate(_layers(1, moe_on_last_stage_only)):
        set_random_seed(1234 + idx)  # PipelineModule(seed_layers=True)'s seeds
        layers.append(spec.build())
    model = torch.nn.Sequential(*layers)
    if not moe_on_last_stage_only:
        _distinct_experts(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for d in range(DATA):
            for j in range(MICRO_BATCHES):
                x, y = _micro_batch(step, d, j)
                loss = _loss(model(x), y) / (DATA * MICRO_BATCHES)
                loss.backward()
                total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)))
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms}


@pytest.mark.parametrize("zero_stage,mesh_first", [(0, True), (2, False), (3, True)])
def test_moe_auxiliary_loss_rides_along_the_pipeline(zero_stage, mesh_first):
    (reference,) = run_ranks(_train_reference, 1)
    results = run_ranks(_train_pipeline, 4, zero_stage, mesh_first, timeout=240)
    assert reference["norms"][0] > 0.3, "clipping is active"
    for r in results:
        assert r["local_experts"] == [EXPERTS // 2], "each stage holds one MoE layer, its experts over 2 ranks"
        assert all(all(step) for step in r["aux_reached"]), "every l_aux got a gradient from the loss"
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6), r
        assert r["norms"] == pytest.approx(reference["norms"], rel=1e-5, abs=1e-6), r


def test_moe_on_one_stage_only_builds_and_trains():
    """pipe 2 x data 2 from num_stages, the MoE layer (ep 2) on stage 1
    only, ZeRO-1: stage 0's ranks never make expert groups, and the job
    trains as one process does (before, stage 1's ranks alone made the
    expert groups on the all-data mesh at construction and hung there)."""
    (reference,) = run_ranks(_train_reference, 1, True)
    results = run_ranks(_train_pipeline, 4, 1, False, True, timeout=240)
    assert [r["local_experts"] for r in results] == [[], [], [EXPERTS // 2], [EXPERTS // 2]]
    for r in results:
        assert all(all(step) for step in r["aux_reached"])
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6), r
        assert r["norms"] == pytest.approx(reference["norms"], rel=1e-5, abs=1e-6), r

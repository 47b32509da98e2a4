"""The pipeline engine on real gloo ranks: `train_batch` over pipe x data
gives the losses and weights of the same model trained on the same global
batch in one process, for every schedule, ZeRO stage 0/1/2 and bf16; tied
weights stay equal; shapes may change per micro-batch; `eval_batch`."""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks

WIDTH, CLASSES, MICRO, STEPS = 8, 4, 2, 3


class Block(torch.nn.Module):
    """Linear + tanh on the last dimension (any leading shape)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Head(torch.nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, classes)

    def forward(self, x):
        return self.linear(x).mean(dim=1)  # (batch, seq, classes) -> (batch, classes)


def _layers(depth: int = 6):
    from dsrun.pipe import LayerSpec
    return [LayerSpec(Block, WIDTH) for _ in range(depth)] + [LayerSpec(Head, WIDTH, CLASSES)]


def _reference_model(depth: int = 6) -> torch.nn.Sequential:
    """The same layers in one process, seeded as PipelineModule(seed_layers=True) seeds them."""
    from dsrun.runtime.utils import set_random_seed
    layers = []
    for idx, spec in enumerate(_layers(depth)):
        set_random_seed(1234 + idx)
        layers.append(spec.build())
    return torch.nn.Sequential(*layers)


def _micro_batch(step: int, data_rank: int, micro: int, seq: int = 3):
    g = torch.Generator().manual_seed(1000 * step + 100 * data_rank + micro)
    seq = seq if seq else 2 + (micro % 3)
    x = torch.randn(MICRO, seq, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (MICRO,), generator=g)
    return x, y


def _config(stages: int, data: int, micro_batches: int, schedule: str, zero_stage: int, bf16: bool,
            virtual: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": micro_batches,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": zero_stage}, "bf16": {"enabled": bf16},
            "gradient_clipping": 1.0, "pipeline": {"schedule": schedule, "virtual_stages": virtual},
            "steps_per_print": 1000}


def _train_pipeline(stages: int, micro_batches: int, schedule: str, zero_stage: int, bf16: bool,
                    virtual: int, variable_seq: bool) -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    world = torch.distributed.get_world_size()
    module = PipelineModule(_layers(), num_stages=stages, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform", virtual_stages=virtual)
    engine, *_ = dsrun.initialize(model=module, config=_config(stages, world // stages, micro_batches, schedule,
                                                                zero_stage, bf16, virtual))
    data_rank = engine.grid.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(STEPS):
        batches = iter([_micro_batch(step, data_rank, j, seq=0 if variable_seq else 3)
                        for j in range(micro_batches)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(engine.get_global_grad_norm())
    weights = {}
    for name, p in module.named_parameters():
        full = dsrun.zero.safe_get_full_fp32_param(p) if engine.strategy.manages(p) else p.detach().float()
        weights[name] = full.clone()
    return {"losses": losses, "norms": norms, "weights": weights, "stage": engine.stage_id, "data": data_rank}


def _train_reference(data: int, micro_batches: int, variable_seq: bool) -> dict:
    import torch.nn.functional as F
    model = _reference_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for d in range(data):
            for j in range(micro_batches):
                x, y = _micro_batch(step, d, j, seq=0 if variable_seq else 3)
                loss = F.cross_entropy(model(x), y) / (data * micro_batches)
                loss.backward()
                total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _check(results: list[dict], reference: dict, rtol: float, atol: float) -> None:
    for r in results:
        assert r["losses"] == pytest.approx(reference["losses"], rel=rtol, abs=atol), r
        # the norm spans every stage (clipping uses the whole model's)
        assert r["norms"] == pytest.approx(reference["norms"], rel=rtol, abs=atol), r
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, reference["weights"][name], rtol=rtol, atol=atol, msg=name)
    held = {name for r in results for name in r["weights"]}
    assert held == set(reference["weights"]), "every layer lives on some stage"


@pytest.mark.parametrize("schedule,stages,micro_batches,virtual", [
    ("1f1b", 2, 4, 1), ("zb-h1", 2, 4, 1), ("interleaved", 2, 4, 2), ("1f1b", 4, 4, 1)])
def test_pipeline_matches_one_process_training(schedule, stages, micro_batches, virtual):
    data = 4 // stages
    results = run_ranks(_train_pipeline, 4, stages, micro_batches, schedule, 0, False, virtual, False)
    _check(results, _train_reference(data, micro_batches, False), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_pipeline_with_zero_stages(zero_stage):
    results = run_ranks(_train_pipeline, 4, 2, 4, "1f1b", zero_stage, False, 1, False)
    _check(results, _train_reference(2, 4, False), rtol=1e-4, atol=1e-5)


def test_pipeline_bf16_zero2_and_variable_sequence_lengths():
    """bf16 compute with fp32 masters, and micro-batches whose sequence length
    changes (metadata is sent whenever the shapes change)."""
    results = run_ranks(_train_pipeline, 4, 2, 4, "1f1b", 2, True, 1, True)
    _check(results, _train_reference(2, 4, True), rtol=5e-2, atol=5e-2)

"""DeepSpeed's helper modules by their DeepSpeed paths: dsrun.utils,
dsrun.runtime.utils, lr_schedules.VALID_LR_SCHEDULES,
runtime.zero.partition_parameters, checkpoint.utils."""
from __future__ import annotations

import logging

import pytest
import torch

import dsrun as deepspeed
from tests.dist_helpers import run_ranks


def test_module_paths_mirror_deepspeed():
    from dsrun.checkpoint.utils import clone_tensors_for_torch_save
    from dsrun.runtime.config import LAMB_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER  # BERT pre-training compares with these
    from dsrun.runtime.lr_schedules import VALID_LR_SCHEDULES
    from dsrun.runtime.utils import move_to_device, see_memory_usage  # noqa: F401
    from dsrun.runtime.zero.partition_parameters import GatheredParameters, Init, ZeroParamStatus  # noqa: F401
    from dsrun.utils import RepeatingLoader, groups, log_dist, logger, set_z3_leaf_modules  # noqa: F401
    assert deepspeed.utils.logger is logger and deepspeed.logger is logger
    assert (LAMB_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER) == ("lamb", "onebitlamb")
    assert {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"} == set(VALID_LR_SCHEDULES)
    base = torch.arange(10.0)
    cloned = clone_tensors_for_torch_save({"a": [base[2:4]], "b": 3})
    assert cloned["b"] == 3 and cloned["a"][0].tolist() == [2.0, 3.0]
    assert cloned["a"][0].untyped_storage().nbytes() == 8  # its own elements, not the base's storage
    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_model_parallel_rank() == 0


def test_repeating_loader_restarts():
    from dsrun.utils import RepeatingLoader
    it = RepeatingLoader([1, 2, 3])
    assert [next(it) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def test_log_dist_and_see_memory_usage(caplog):
    from dsrun.runtime.utils import see_memory_usage
    from dsrun.utils import log_dist, logger
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="dsrun"):
            log_dist("hello", ranks=[0])
            see_memory_usage("not forced")
            see_memory_usage("after build", force=True)
    finally:
        logger.propagate = False
    text = caplog.text
    assert "hello" in text and "not forced" not in text and "after build | MA" in text


def test_move_to_device_and_set_random_seed():
    from dsrun.runtime.utils import move_to_device, set_random_seed
    item = {"x": (torch.ones(1), [torch.zeros(2)]), "n": 1}
    moved = move_to_device(item, torch.device("meta"), criterion_func=lambda t: t.numel() == 2)
    assert moved["x"][0].device.type == "cpu" and moved["x"][1][0].device.type == "meta"
    set_random_seed(3)
    a = torch.rand(2)
    set_random_seed(3)
    assert torch.equal(a, torch.rand(2))


def test_set_z3_leaf_modules_rejects_no_match():
    from dsrun.utils import set_z3_leaf_modules
    with pytest.raises(ValueError, match="no module of class Missing"):
        set_z3_leaf_modules(torch.nn.Linear(2, 2), ["Missing"])


class _Experts(torch.nn.Module):
    """Routes each micro-batch to ONE expert chosen by the rank: ranks run
    different experts, as a Mixture-of-Experts layer does."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        return self.experts[int(x[0, 0, 0].item() > 0)](x)


class _TiedHead(torch.nn.Module):
    """Output layer reading the embedding's weight (owned by another unit)."""

    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__()
        self.ref = [embedding]  # not a submodule: the weight is external to this module

    def forward(self, h):
        return h @ self.ref[0].weight.t()


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.ModuleList([torch.nn.Embedding(16, 8)])  # its own stage-3 unit
        self.blocks = torch.nn.ModuleList([_Experts(), torch.nn.Linear(8, 8)])
        self.head = torch.nn.ModuleList([_TiedHead(self.embed[0])])

    def forward(self, ids):
        h = self.embed[0](ids)
        for b in self.blocks:
            h = b(h)
        return torch.nn.functional.cross_entropy(self.head[0](h).flatten(0, 1), ids.flatten())


def _train_moe_like(stage: int) -> list[float]:
    import dsrun as deepspeed
    from dsrun.utils import set_z3_leaf_modules
    torch.manual_seed(0)
    net = _Net()
    set_z3_leaf_modules(net, [_Experts])
    deepspeed.zero.register_external_parameter(net.head[0], net.embed[0].weight)
    engine, *_ = deepspeed.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    rank = deepspeed.comm.get_rank()
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, 16, (2, 5), generator=g)
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 5))
    return losses


@pytest.mark.slow
def test_leaf_and_external_parameters_under_stage3():
    """Ranks route to different experts and the head reads the embedding's
    weight: stage 3 neither hangs nor reads an empty weight, and trains as
    stage 0 does."""
    assert run_ranks(_train_moe_like, 2, 3, timeout=180) == run_ranks(_train_moe_like, 2, 0, timeout=180)

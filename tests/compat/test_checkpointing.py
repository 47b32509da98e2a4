"""dsrun.checkpointing: DeepSpeed's activation checkpointing API on torch's
non-reentrant checkpoint; host and model-parallel placement of the inputs."""
from __future__ import annotations

import json

import pytest
import torch

import dsrun as deepspeed
from dsrun.runtime.activation_checkpointing import checkpointing
from tests.dist_helpers import run_ranks


@pytest.fixture(autouse=True)
def _fresh_options(monkeypatch):
    for name, value in vars(checkpointing._Options).copy().items():
        if not name.startswith("_"):
            monkeypatch.setattr(checkpointing._Options, name, value)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x, scale):
        return torch.nn.functional.gelu(self.drop(self.fc(x))) * scale + x


def _grads(use_checkpoint: bool, seed: int = 0):
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList(_Block() for _ in range(3))
    x = torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(100)
    h = x
    for b in blocks:
        h = deepspeed.checkpointing.checkpoint(b, h, 0.5) if use_checkpoint else b(h, 0.5)
    loss = h.square().mean()
    loss.backward()
    return loss.item(), x.grad.clone(), [p.grad.clone() for p in blocks.parameters()]


def test_checkpoint_matches_plain_backward_with_dropout():
    plain = _grads(False)
    checkpointing.configure(None)
    ckpt = _grads(True)
    assert plain[0] == ckpt[0] and torch.equal(plain[1], ckpt[1])
    assert all(torch.equal(a, b) for a, b in zip(plain[2], ckpt[2]))
    assert deepspeed.checkpointing.is_configured()
    deepspeed.checkpointing.reset()


def test_checkpoint_frees_what_the_region_saves():
    """Inside a checkpointed region autograd saves nothing: the region is recomputed."""
    saved = []

    def count(t):
        saved.append(t.numel())
        return t

    block = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        block(x).sum()
    plain = sum(saved)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        deepspeed.checkpointing.checkpoint(block, x).sum()
    assert plain > 4 * 32 * 64 and sum(saved) < plain / 4


def test_configure_from_config_dict_file_and_keywords(tmp_path):
    section = {"partition_activations": True, "cpu_checkpointing": False, "synchronize_checkpoint_boundary": True,
               "profile": True, "number_checkpoints": 3}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, "activation_checkpointing": section}))
    checkpointing.configure(None, deepspeed_config=str(path), checkpoint_in_cpu=True, profile=False)
    o = checkpointing._Options
    assert o.partition_activations and o.cpu_checkpointing and o.synchronize and not o.profile
    assert o.num_checkpoints == 3
    with pytest.raises(Exception, match="partition_activations"):
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activations": "x"}})


def test_initialize_applies_the_config_section():
    model = torch.nn.Linear(2, 2)
    deepspeed.initialize(model=model, config={
        "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "activation_checkpointing": {"synchronize_checkpoint_boundary": True}})
    assert checkpointing.is_configured() and checkpointing._Options.synchronize


def test_cpu_checkpointing_keeps_inputs_on_the_host(monkeypatch):
    """The host copy runs where a GPU exists; on the CPU the same ops run as
    CPU-to-CPU copies, which must not change any gradient."""
    plain = _grads(False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    checkpointing.configure(None, checkpoint_in_cpu=True)
    moved = []
    original = checkpointing._ToHost.forward
    monkeypatch.setattr(checkpointing._ToHost, "forward",
                        staticmethod(lambda ctx, x: moved.append(x.shape) or original(ctx, x)))
    ckpt = _grads(True)
    assert len(moved) == 3 and torch.equal(plain[1], ckpt[1])
    assert all(torch.equal(a, b) for a, b in zip(plain[2], ckpt[2]))


class _WorldMpu:
    """A model-parallel unit whose group is all ranks (Megatron's method names)."""

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_rank(self):
        return deepspeed.comm.get_rank()

    def get_model_parallel_world_size(self):
        return deepspeed.comm.get_world_size()


def _partitioned() -> tuple:
    import dsrun as deepspeed
    from dsrun.runtime.activation_checkpointing import checkpointing as ck
    deepspeed.init_distributed()
    plain = _grads(False)
    ck.configure(_WorldMpu(), partition_activations=True)
    kept = []
    original = ck._KeepSlice.forward
    ck._KeepSlice.forward = staticmethod(lambda ctx, *a: kept.append(original(ctx, *a).numel()) or original(ctx, *a))
    deepspeed.comm.comms_logger.reset()
    ckpt = _grads(True)
    gathers = deepspeed.comm.comms_logger.snapshot()["all_gather_into_tensor"].calls
    same = torch.equal(plain[1], ckpt[1]) and all(torch.equal(a, b) for a, b in zip(plain[2], ckpt[2]))
    return same, kept, gathers


def test_partition_activations_across_the_model_parallel_group():
    for same, kept, gathers in run_ranks(_partitioned, 2, timeout=120):
        assert same
        assert kept == [4 * 16 // 2] * 3  # each rank keeps half of each (4, 16) input
        assert gathers >= 6  # forward, recompute (and the gradients)


def test_rng_tracker_forks_and_restores():
    checkpointing.configure(None)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(42)
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b) and torch.equal(torch.get_rng_state(), outside)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 7)
    with pytest.raises(KeyError):
        with tracker.fork("nope"):
            pass

"""dsrun.accelerator.get_accelerator(): DeepSpeed's accelerator interface.

The CPU accelerator's tests ask for it (DS_ACCELERATOR=cpu), so they hold on
a machine with a GPU too; the CUDA ones run where torch sees a GPU.
"""
from __future__ import annotations

import pytest
import torch

import dsrun as deepspeed
from dsrun.accelerator import DeepSpeedAccelerator, get_accelerator, real_accelerator, set_accelerator


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(real_accelerator, "_current", None)
    yield
    real_accelerator._current = None


@pytest.fixture
def cpu(fresh, monkeypatch):
    """The CPU accelerator, whatever devices this machine has."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def test_cpu_accelerator_answers_like_deepspeeds(cpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    acc = get_accelerator()
    assert acc is get_accelerator() is deepspeed.get_accelerator()
    assert isinstance(acc, DeepSpeedAccelerator)
    assert acc.device_name() == "cpu" and acc.device_name(1) == "cpu"
    assert acc.current_device_name() == "cpu" and acc.current_device() == 1
    assert acc.device_count() == 2
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_available() and acc.is_synchronized_device() and acc.use_host_timers()
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    assert acc.supported_dtypes() == [torch.float, torch.bfloat16, torch.half]
    assert acc.device() == torch.device("cpu")
    x = torch.randn(3, device=acc.current_device_name())
    assert acc.on_accelerator(x)
    assert acc.pin_memory(x) is x and not acc.is_pinned(x)
    assert acc.FloatTensor([1, 2]).dtype == torch.float32 and acc.LongTensor([1]).dtype == torch.int64
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    assert acc.Event is None
    with acc.stream(acc.Stream()):
        pass
    assert acc.visible_devices_envs() == [] and acc.export_envs() == []


def test_memory_queries_report_this_process(cpu):
    acc = get_accelerator()
    before = acc.memory_allocated()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert acc.memory_allocated() >= before + 32 * 2**20
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.total_memory() > acc.available_memory() > 0
    del block


def test_seeding_reproduces(cpu):
    acc = get_accelerator()
    acc.manual_seed(7)
    a = torch.randn(4)
    acc.manual_seed_all(7)
    assert torch.equal(a, torch.randn(4))
    state = acc.get_rng_state()
    b = torch.randn(4)
    acc.set_rng_state(state)
    assert torch.equal(b, torch.randn(4)) and acc.initial_seed() == 7


def test_ds_accelerator_env(fresh, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'"):
        get_accelerator()
    if not torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", "cuda")
        with pytest.raises(ValueError, match="no CUDA device"):
            get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator()._name == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_accelerator_is_the_default_with_a_gpu(fresh, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    acc = get_accelerator()
    assert acc.device_name() == "cuda" and acc.communication_backend_name() == "nccl"
    before = acc.memory_allocated()
    block = torch.ones(64 * 2**20 // 4, device=acc.current_device_name())  # 64 MiB on the GPU
    assert acc.memory_allocated() >= before + 64 * 2**20 and acc.on_accelerator(block)
    host = acc.pin_memory(torch.ones(4))
    assert acc.is_pinned(host)
    acc.manual_seed_all(7)
    a = torch.randn(4, device=block.device)
    acc.manual_seed_all(7)
    assert torch.equal(a, torch.randn(4, device=block.device))


def test_set_accelerator(fresh):
    class Custom(DeepSpeedAccelerator):
        _name, _communication_backend_name = "cpu", "gloo"
    mine = Custom()
    set_accelerator(mine)
    assert get_accelerator() is mine


def test_op_builder_names_dsrun_ops(fresh):
    with pytest.raises(NotImplementedError, match="dsrun.ops"):
        get_accelerator().create_op_builder("CPUAdamBuilder")


def test_runtime_backend_follows_the_accelerator(fresh, monkeypatch):
    from dsrun.runtime.distributed import dist as runtime_dist

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # gloo even where a GPU is visible
    assert runtime_dist._pick_backend(None) == "gloo"
    assert runtime_dist._pick_backend("nccl") == "nccl"  # init_distributed(dist_backend=...) wins

    class OnCuda(DeepSpeedAccelerator):
        _name, _communication_backend_name = "cuda", "nccl"
    set_accelerator(OnCuda())
    assert runtime_dist._pick_backend(None) == "nccl"

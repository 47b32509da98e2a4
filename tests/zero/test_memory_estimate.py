"""ZeRO memory formulas (paper, SC20) and tensor accounting."""
import pytest
import torch

from dsrun.runtime.memory.accounting import estimate_zero_memory, tensor_breakdown


@pytest.mark.parametrize("n", [1, 4, 64])
def test_paper_formulas_mixed_adam(n):
    psi = 1024 * 64  # divisible by every n: no padding
    per = lambda stage: estimate_zero_memory(psi, n, stage, "bf16", grad_accum_dtype="bf16").bytes_per_param()
    assert per(0) == pytest.approx(16)
    # dsrun's stage 1 reduces in place: its gradient shard is part of the full buffer.
    assert per(1) == pytest.approx(4 + 12 / n)
    assert per(2) == pytest.approx(2 + 14 / n)
    assert per(3) == pytest.approx(16 / n)


def test_fp32_default_grads_and_padding():
    est = estimate_zero_memory(10, 4, 2, "fp32")  # padded to 12, shard 3
    assert est.categories == {"params": {"fp32": 48}, "grads": {"fp32": 12}, "master": {},
                              "optimizer_states": {"fp32": 24}}
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))  # 12 + 4 params
    est = estimate_zero_memory(model, 3, 1, "bf16", bucket_numel=12)  # buckets 12 and 4 -> 12 + 6
    assert est.num_params == 16 and est.categories["params"] == {"bf16": 36}
    assert est.categories["grads"] == {"fp32": 18 * 4}
    assert est.categories["master"] == {"fp32": 6 * 4}
    with pytest.raises(ValueError, match="stage"):
        estimate_zero_memory(10, 2, 4)
    with pytest.raises(ValueError, match="dtype"):
        estimate_zero_memory(10, 2, 1, "int8")


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_optimizer_offload_moves_stage_2_3_gradients_to_the_host(device):
    psi, n = 1024 * 64, 4
    for stage in (0, 1, 2, 3):
        est = estimate_zero_memory(psi, n, stage, "bf16", offload_optimizer=device)
        cats = {k: sum(v.values()) for k, v in est.categories.items()}
        tiers = est.tiers()
        buffers = cats.get("offload_buffers", 0)  # NVMe's host streaming buffers
        if stage >= 2:  # reduced gradient partitions live where the optimizer steps
            assert est.placement["grads"] == "host"
            assert tiers["device"] == cats["params"]
            assert tiers["host"] == cats["grads"] + buffers + (cats["master"] + cats["optimizer_states"]
                                                              if device == "cpu" else 0)
        else:  # the full gradient buffer accumulates beside the parameters
            assert "grads" not in est.placement
            assert tiers["device"] == cats["params"] + cats["grads"]
        no_offload = estimate_zero_memory(psi, n, stage, "bf16")
        assert est.total - buffers == no_offload.total  # the same bytes, on other tiers


def test_tensor_breakdown_counts_storage_once():
    flat = torch.zeros(10, dtype=torch.bfloat16)
    views = [flat[:3], flat[3:7]]
    out = tensor_breakdown({"params": views + [flat], "grads": [torch.zeros(5), None]})
    assert out == {"params": {"bf16": 20}, "grads": {"fp32": 20}}

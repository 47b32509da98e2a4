"""Where the offload paths put each tensor, and the offload copies' arithmetic, on CPU.

On a CPU-only machine the compute device and host memory are both `cpu`, so
a test cannot see which device a tensor was meant for. The tiers take the
offload device as an argument: `meta` stands for a second device in the
construction tests (every buffer that follows the offload device lands on
`meta`, every one that follows the compute device on `cpu`), and
`torch.device("cpu", 0)`, a device that compares unequal to `cpu` while its
tensors are ordinary CPU tensors, runs the whole copy path of [Note:
offload copies] (offload/transfer.py) end to end, values included.
"""
import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.zero.models import base_config, train


def _patch_tiers(opt_device, param_device):
    """Make dsrun.initialize build tiers whose host memory is the given device."""
    from dsrun.runtime import zero
    from dsrun.runtime.offload import build_optimizer_tier, build_param_tier

    def opt_tier(cfg, topology):
        tier = build_optimizer_tier(cfg, topology)
        tier.offload_device = torch.device(opt_device)
        return tier

    def param_tier(cfg, topology):
        tier = build_param_tier(cfg, topology)
        tier.offload_device = torch.device(param_device)
        return tier
    zero.build_optimizer_tier, zero.build_param_tier = opt_tier, param_tier


def _devices(stage, offload_optimizer, offload_param):
    import dsrun
    from tests.zero.models import TinyGPT

    _patch_tiers("meta", "meta")
    cfg = base_config(stage, "bf16", reduce_bucket_size=300, stage3_param_persistence_threshold=0,
                      offload_optimizer={"device": offload_optimizer},
                      **({"offload_param": {"device": offload_param}} if stage == 3 else {}))
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    s = engine.strategy
    out = {"master": {str(f.master.device) for f in s.sets if f.master is not None},
           "grads": {str(f.grad_partition.device) for f in s.sets},
           "staging": {str(r.buffer().device) for r in s.reducer.regions},
           "host_grads": s.optimizer_tier.host_grads is not None,
           "reducer_host_grads": s.reducer.host_grads is s.optimizer_tier.host_grads,
           "uploads": s.optimizer_tier.uploads is not None}
    if stage == 3:
        out["partition"] = {str(f.partition.device) for f in s.sets}
        out["gathered"] = {str(u.full.device) for u in s.units}
        out["released"] = {str(p.data.device) for p in model.parameters()}
    else:
        out["full"] = {str(f.full.device) for f in s.sets}
        out["params"] = {str(p.device) for p in model.parameters()}
    return out


def test_optimizer_offload_buffers_follow_their_device():
    """Stage 2 + offload_optimizer: master and gradient partition on the
    offload device; parameters, the flat buffer and the reduction buckets on
    the compute device; the copy path is set up."""
    (d,) = run_ranks(_devices, 1, 2, "cpu", "none")
    assert d["master"] == {"meta"} and d["grads"] == {"meta"}
    assert d["full"] == {"cpu"} and d["params"] == {"cpu"} and d["staging"] == {"cpu"}
    assert d["host_grads"] and d["reducer_host_grads"] and d["uploads"]


def test_param_offload_gathers_on_the_compute_device():
    """Stage 3 + offload_param (the issue's failure: gathered buffers were
    built where the partition is): partitions on the offload device,
    gathered units, released parameters and buckets on the compute device;
    gradients stay there without optimizer offload."""
    (d,) = run_ranks(_devices, 1, 3, "none", "cpu")
    assert d["partition"] == {"meta"}
    assert d["gathered"] == {"cpu"} and d["released"] == {"cpu"} and d["staging"] == {"cpu"}
    assert d["grads"] == {"cpu"} and d["master"] == {"cpu"}
    assert not d["host_grads"] and not d["uploads"]


def test_both_offloads_at_stage3():
    (d,) = run_ranks(_devices, 1, 3, "cpu", "cpu")
    assert d["partition"] == {"meta"} and d["master"] == {"meta"} and d["grads"] == {"meta"}
    assert d["gathered"] == {"cpu"} and d["staging"] == {"cpu"} and d["host_grads"]


def _cpu_model_copy_path():
    import dsrun
    from tests.zero.models import TinyGPT

    cfg = base_config(2, "bf16", offload_optimizer={"device": "cpu"})
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    model = TinyGPT()
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    tier = engine.strategy.optimizer_tier
    return tier.host_grads, tier.uploads, [f.grads_offloaded for f in engine.strategy.sets]


def test_no_copy_path_when_host_is_the_device():
    """A CPU model with offload_optimizer cpu: nothing is copied (no host
    gradients, no uploader), as before."""
    (out,) = run_ranks(_cpu_model_copy_path, 1)
    assert out[0] is None and out[1] is None and not any(out[2])


# ---- the copy path, values included, with cpu:0 as the second device ----------------------------

def _train_fake_device(stage, prec, gas, clip, offload):
    if offload:
        _patch_tiers(torch.device("cpu", 0), "cpu")
    cfg = base_config(stage, prec, gas=gas, sub_group_size=100, reduce_bucket_size=300,
                      stage3_param_persistence_threshold=40,
                      offload_optimizer={"device": "cpu" if offload else "none"})
    cfg["gradient_clipping"] = clip
    losses, full, engine = train(cfg, steps=3, optimizer="config")
    tier = engine.strategy.optimizer_tier
    timeline = engine.offload_timeline()  # empty without offload from another device
    used = tier.host_grads is not None
    tier.close()
    return losses, full, used, timeline


@pytest.mark.parametrize("stage,prec,gas", [(2, "bf16", 1), (2, "bf16", 2), (2, "fp32", 2), (3, "bf16", 2),
                                            (2, "fp16", 1)])
def test_copy_path_equals_no_offload(stage, prec, gas):
    """Gradients through the host-gradient copies (staging, cast and average
    on the worker thread, fresh write then accumulation) give the losses and
    masters of no offload bit for bit (no clipping: the norm is summed in
    another order on the device, see the next test)."""
    ref = run_ranks(_train_fake_device, 2, stage, prec, gas, 0.0, False)
    off = run_ranks(_train_fake_device, 2, stage, prec, gas, 0.0, True)
    for (l0, f0, used0, tl0), (l1, f1, used1, tl) in zip(ref, off):
        assert not used0 and used1 and tl0 == {}
        assert l0 == l1
        for n in f0:
            assert torch.equal(f0[n], f1[n]), n
        assert tl["totals"]["grads on host"]["count"] > 0 and tl["totals"]["adam"]["count"] > 0
        assert tl["totals"]["backward"]["count"] == gas  # one interval per micro-step


def test_copy_path_with_clipping_matches_no_offload():
    """With clipping the norm (device sum of the regions when fresh, host
    norm after accumulation) differs from no offload only by rounding."""
    for gas in (1, 2):
        ref = run_ranks(_train_fake_device, 2, 2, "fp32", gas, 0.05, False)
        off = run_ranks(_train_fake_device, 2, 2, "fp32", gas, 0.05, True)
        for (l0, f0, _, _), (l1, f1, _, _) in zip(ref, off):
            assert l0 == pytest.approx(l1, rel=1e-5)
            for n in f0:
                torch.testing.assert_close(f0[n], f1[n], rtol=1e-5, atol=1e-6)


# ---- the transfer classes on their own -------------------------------------------------------------

def test_host_gradients_write_then_add_and_norm():
    from dsrun.runtime.offload.transfer import (
        CopyStream,
        HostGradients,
        OffloadTimeline,
    )

    tl = OffloadTimeline()
    hg = HostGradients(CopyStream(torch.device("cpu"), tl), tl)
    target = torch.full((6,), 7.0)  # stale values: the first micro-step overwrites them
    a = torch.tensor([1.0, -2.0, 3.0, 0.5, 0.25, 4.0], dtype=torch.bfloat16)
    hg.begin()
    hg.add(target, a, 2)
    hg.drain()
    assert torch.equal(target, a.float() / 2)
    assert hg.sq_norm([target], torch.device("cpu")).item() == pytest.approx(float((a.float() / 2).square().sum()))
    hg.add(target, a, 2)  # second micro-step: adds
    hg.drain()
    assert torch.equal(target, a.float())
    assert hg.sq_norm([target], torch.device("cpu")).item() == pytest.approx(float(a.float().square().sum()))
    hg.reset()  # a step without backward: zeroed, norm 0
    assert hg.sq_norm([target], torch.device("cpu")).item() == 0.0 and not target.any()
    with pytest.raises(ValueError, match="6 elements"):
        hg.add(target, torch.ones(5), 1)
    tl.end()
    hg.close()


def test_uploader_rotates_buffers_and_copies():
    from dsrun.runtime.offload.transfer import (
        CopyStream,
        OffloadTimeline,
        Uploader,
        format_timeline,
    )

    tl = OffloadTimeline()
    tl.begin(torch.device("cpu"))
    up = Uploader(CopyStream(torch.device("cpu"), tl), tl, count=2)
    dst = torch.zeros(10, dtype=torch.bfloat16)
    seen = []
    for lo in (0, 4, 8):
        hi = min(lo + 4, 10)
        buf = up.buffer(hi - lo, torch.bfloat16)
        seen.append(buf.data_ptr())
        buf.copy_(torch.arange(lo, hi, dtype=torch.bfloat16))
        up.send(buf, dst[lo:hi])
    up.finish()
    assert torch.equal(dst, torch.arange(10, dtype=torch.bfloat16))
    assert seen[0] == seen[2] != seen[1]  # two buffers, in turn
    record = tl.end()
    assert "wait params" in format_timeline(record) and record["wall_ms"] >= 0


# ---- on a GPU (skipped without one) --------------------------------------------------------------

def _cuda_run(stage, opt, param):
    cfg = base_config(stage, "bf16", reduce_bucket_size=300, stage3_param_persistence_threshold=40,
                      offload_optimizer={"device": opt, "pin_memory": True},
                      **({"offload_param": {"device": param, "pin_memory": True}} if stage == 3 else {}))
    losses, _, engine = train(cfg, steps=4, optimizer="config")
    s = engine.strategy
    out = {"losses": losses, "device": str(engine.device),
           "host_grads_pinned": [f.grad_partition.is_pinned() for f in s.sets if f.grads_offloaded],
           "timeline": engine.offload_timeline()}
    if stage == 3:
        out["partitions"] = {f.partition.device.type for f in s.sets}
        out["gathered"] = {u.full.device.type for u in s.units}
    s.optimizer_tier.close()
    return out


@pytest.mark.parametrize("stage,opt,param", [(2, "cpu", "none"), (3, "none", "cpu"), (3, "cpu", "cpu")])
def test_cuda_offload_trains_like_no_offload(cuda, stage, opt, param):
    """On CUDA (the issue's failures): offloaded runs train, gathered units
    are on the GPU and partitions in host memory, gradients reach pinned
    host memory, and the losses follow no offload (GPU Adam there, CPU Adam
    here: equal up to rounding)."""
    (ref,) = run_ranks(_cuda_run, 1, stage, "none", "none")
    (off,) = run_ranks(_cuda_run, 1, stage, opt, param)
    assert off["device"].startswith("cuda")
    assert off["losses"] == pytest.approx(ref["losses"], rel=2e-2)
    if opt == "cpu":
        assert off["host_grads_pinned"] and all(off["host_grads_pinned"])
        assert off["timeline"]["totals"]["grads d2h"]["count"] > 0
        assert off["timeline"]["totals"]["params h2d"]["count"] > 0 or stage == 3
    if stage == 3:
        assert off["gathered"] == {"cuda"} and off["partitions"] == {"cpu"}


def test_timeline_format_shows_each_kind():
    from dsrun.runtime.offload.transfer import KINDS, format_timeline

    record = {"wall_ms": 100.0, "totals": {k: {"ms": 10.0, "bytes": 2**20, "count": 1} for k in KINDS},
              "intervals": [("backward", 0.0, 50.0), ("adam", 50.0, 100.0)]}
    lines = format_timeline(record, width=10).splitlines()
    assert len(lines) == 1 + len(KINDS)
    backward = next(line for line in lines if line.strip().startswith("backward"))
    adam = next(line for line in lines if line.strip().startswith("adam"))
    assert backward.endswith("|######    |") and adam.endswith("|     #####|")
    assert format_timeline({}) == ""

"""ZeRO++ zero_quantized_nontrainable_weights: frozen parameters' stage-3
shards kept as block-wise int8, quantized once, gathered as int8.

The model: TinyGPT(d=64, untied) with a frozen embedding (wte, 37 x 64, in
the root unit with trainable ln_f and head) and a frozen first block (h.0,
a unit with no trainable parameter at all), on 2 gloo ranks, fp32.

Bound on the frozen weights: a rank's frozen shards are quantized as one
vector in blocks of 256 elements with s = max|block| / 127, so every frozen
weight the forward sees is within s / 2 = max|block| / 254 of its true
value (0.39% of its block's largest magnitude), and the test checks the
gathered values against that quantization recomputed here bit for bit.
Losses: such a perturbation of the frozen embedding and first block (their
outputs pass LayerNorms before the head) moves each loss by far less than
the 0.5% relative tolerance asserted (measured: under 0.05%).
"""
from __future__ import annotations

import pytest
import torch

from dsrun.runtime.comm.quantized import dequantize_blockwise, message_numel, quantize_blockwise
from dsrun.runtime.memory.accounting import estimate_zero_memory
from tests.dist_helpers import run_ranks
from tests.zero.models import TinyGPT, base_config, batches, full_param, mean_loss_step, param_groups

BLOCK = 256
FROZEN = ("wte.", "h.0.")


def _model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    model = TinyGPT(d=64, tie=False)
    for n, p in model.named_parameters():
        if n.startswith(FROZEN):
            p.requires_grad_(False)
    return model


def _engine(qnw: bool, seed: int = 0, precision: str = "fp32", **zero):
    import dsrun
    model = _model(seed)
    cfg = base_config(3, precision, world_size=2, stage3_param_persistence_threshold=0,
                      zero_quantized_nontrainable_weights=qnw, **zero)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    engine, *_ = dsrun.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine, model


def _steps(engine, steps: int, first: int = 0) -> list[float]:
    from dsrun.runtime import comm
    return [mean_loss_step(engine, idx, tgt) for idx, tgt in batches(comm.get_rank(), first + steps, 2, 1)[first:]]


def _expected_frozen_shards(engine, originals: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each frozen parameter as the forward must see it: this rank's frozen
    shards of each unit in the compute dtype quantized as one vector (blocks
    of 256), decoded, and every rank's pieces summed (recomputed here from
    the layout)."""
    from dsrun.runtime import comm
    out = {}
    for fset in engine.strategy.sets:
        layout, t = fset.layout, fset.trainable_shard_numel
        if layout.shard_numel == t:
            continue  # no frozen parameter in this unit
        shard = torch.zeros(layout.shard_numel - t)
        pieces = [pc for pc in layout.local_pieces(fset.rank) if fset.key_of_bucket[pc.slot.bucket] is None]
        for pc in pieces:
            flat = originals[pc.slot.name].reshape(-1)
            shard[pc.shard_offset - t:pc.shard_offset - t + pc.hi - pc.lo] = flat[pc.lo:pc.hi]
        shard = shard.to(dtype).float()
        q, scales = quantize_blockwise(shard, BLOCK)
        decoded = dequantize_blockwise(q, scales)[:shard.numel()].to(dtype).float()
        # |error| <= s / 2 per block (plus the rounding of the decoded value to bf16)
        bound = torch.zeros(scales.numel() * BLOCK)
        bound[:shard.numel()] = (decoded - shard).abs() - (dtype != torch.float32) * decoded.abs() * 2**-8
        assert (bound.view(-1, BLOCK) <= scales.unsqueeze(1) / 2 * (1 + 1e-6)).all()
        for slot in layout.slots:
            if fset.key_of_bucket[slot.bucket] is None:
                out[slot.name] = torch.zeros(slot.numel)
        for pc in pieces:
            out[pc.slot.name][pc.lo:pc.hi] = decoded[pc.shard_offset - t:pc.shard_offset - t + pc.hi - pc.lo]
    for name, v in out.items():
        comm.all_reduce(v)
        out[name] = v.view(originals[name].shape).to(dtype)
    return out


def _rank_compare(steps: int, precision: str):
    import dsrun
    from dsrun.runtime import comm
    res = {}
    for qnw in (False, True):
        engine, model = _engine(qnw, precision=precision)
        originals = {n: p.detach().clone() for n, p in _model().named_parameters()}
        # What forward sees, gathered: frozen = int8-rounded originals, trainable = exact.
        params = list(model.named_parameters())
        with dsrun.zero.GatheredParameters([p for _, p in params]):
            seen = {n: p.detach().clone() for n, p in params}
        dtype = engine.strategy.precision.compute_dtype
        expected = _expected_frozen_shards(engine, originals, dtype) if qnw else {}
        comm.comms_logger.reset()
        calls, record = [], comm.comms_logger.record  # every collective: (op, dtype, elements)

        def spy(op, t, *args, **kwargs):
            calls.append((op, t.dtype, t.numel()))
            record(op, t, *args, **kwargs)
        comm.comms_logger.record = spy
        losses = _steps(engine, steps)
        comm.comms_logger.record = record
        stats = {op: (s.calls, s.bytes) for op, s in comm.comms_logger.snapshot().items()}
        res[qnw] = {"losses": losses, "seen": seen, "originals": originals, "expected": expected,
                    "memory": engine.memory_breakdown()["params"], "stats": stats, "calls": calls,
                    "frozen_shard_numel": [f.frozen_shard_numel for f in engine.strategy.sets],
                    "full": {n: full_param(engine, p) for n, p in model.named_parameters()},
                    "ds_tensor": {n: p.ds_tensor.dtype for n, p in params}}
    return res


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_frozen_int8_shards_losses_memory_and_bytes(precision):
    steps = 4
    res = run_ranks(_rank_compare, 2, steps, precision, timeout=240)[0]
    plain, qnw = res[False], res[True]
    dtype, name, elem = (torch.float32, "fp32", 4) if precision == "fp32" else (torch.bfloat16, "bf16", 2)
    frozen = [n for n in plain["originals"] if n.startswith(FROZEN)]
    trainable = [n for n in plain["originals"] if not n.startswith(FROZEN)]
    # Forward's weights: trainable exact, frozen exactly the int8 rounding of their shards.
    for n in trainable:
        assert torch.equal(qnw["seen"][n], plain["originals"][n].to(dtype)), n
        assert torch.equal(plain["seen"][n], plain["originals"][n].to(dtype)), n
    for n in frozen:
        assert torch.equal(plain["seen"][n], plain["originals"][n].to(dtype)), n
        assert torch.equal(qnw["seen"][n], qnw["expected"][n]), n
        if plain["originals"][n].dim() == 2:  # (LayerNorm's ones and zeros are exact in int8)
            assert not torch.equal(qnw["seen"][n], plain["seen"][n]), n  # really rounded
        assert qnw["ds_tensor"][n] == torch.int8 and plain["ds_tensor"][n] == dtype
    # Losses within 0.5% of plain stage 3 (see the module docstring), both decreasing.
    for a, b in zip(plain["losses"], qnw["losses"]):
        assert abs(a - b) <= 5e-3 * abs(a), (plain["losses"], qnw["losses"])
    assert qnw["losses"][-1] < qnw["losses"][0]
    # Frozen values never change; full reads give the decoded ones.
    for n in frozen:
        assert torch.equal(qnw["full"][n], qnw["expected"][n].float()), n
    # Memory: the frozen shards (4 B/element in fp32, 2 in bf16) become int8 messages (1 B + 4 B per 256).
    frozen_elems = sum(qnw["frozen_shard_numel"])
    int8 = qnw["memory"]["int8"]
    assert int8 == sum(message_numel(n, BLOCK) for n in qnw["frozen_shard_numel"] if n)
    assert plain["memory"][name] - qnw["memory"][name] == elem * frozen_elems
    assert 0.95 * elem < elem * frozen_elems / int8 <= elem
    assert "int8" not in plain["memory"]
    # All-gather bytes: each gather of a unit's frozen buckets sends both ranks' int8
    # messages instead of both ranks' shards; the same gathers happen in both runs.
    gather_ops = ("all_gather_into_tensor", "all_reduce", "overlapped_all_gather")
    sent = lambda r: sum(elem * n for op, dt, n in r["calls"] if op in gather_ops and dt == dtype)
    int8_calls = [n for op, dt, n in qnw["calls"] if dt == torch.int8]
    assert not [c for c in plain["calls"] if c[1] == torch.int8]
    per_unit = {2 * message_numel(n, BLOCK): 2 * elem * n for n in qnw["frozen_shard_numel"] if n}
    assert int8_calls and all(n in per_unit for n in int8_calls)
    assert sent(plain) - sent(qnw) == sum(per_unit[n] for n in int8_calls)
    saved = sum(per_unit[n] for n in int8_calls) / sum(int8_calls)
    assert 0.95 * elem < saved <= elem, saved
    assert qnw["stats"]["logical_all_gather"][1] == plain["stats"]["logical_all_gather"][1]


def _rank_checkpoint(path: str):
    from dsrun.runtime import comm
    engine, model = _engine(True)
    _steps(engine, 2)
    messages = [f.frozen_message.clone() for f in engine.strategy.sets if f.frozen_message is not None]
    full = {n: full_param(engine, p) for n, p in model.named_parameters()}
    engine.save_checkpoint(path, tag="t")
    engine.save_checkpoint(path, tag="nofrozen", exclude_frozen_parameters=True)
    cont = _steps(engine, 2, first=2)
    staged = [f.frozen_staging for f in engine.strategy.sets]
    # A fresh engine from other initial values: the load restores everything, frozen included.
    other, omodel = _engine(True, seed=1)
    other.load_checkpoint(path, tag="t")
    after = [f.frozen_message for f in other.strategy.sets if f.frozen_message is not None]
    restored = {n: full_param(other, p) for n, p in omodel.named_parameters()}
    resumed = _steps(other, 2, first=2)
    # The checkpoint's frozen values are full fp32: a plain stage-3 engine loads them as they are.
    plain, pmodel = _engine(False, seed=1)
    plain.load_checkpoint(path, tag="t")
    into_plain = {n: full_param(plain, p) for n, p in pmodel.named_parameters()}
    # exclude_frozen_parameters: frozen values stay the loading engine's own (seed 0 = the saved ones).
    same_init, smodel = _engine(True)
    same_init.load_checkpoint(path, tag="nofrozen")
    nofrozen = {n: full_param(same_init, p) for n, p in smodel.named_parameters()}
    comm.barrier()
    return {"messages": messages, "after": after, "full": full, "restored": restored, "cont": cont,
            "resumed": resumed, "into_plain": into_plain, "nofrozen": nofrozen, "staged": staged}


def test_checkpoint_round_trip(tmp_path):
    results = run_ranks(_rank_checkpoint, 2, str(tmp_path), timeout=240)
    for r in results:
        assert all(s is None for s in r["staged"])  # the decoded staging copy is freed by the next step
        assert len(r["messages"]) == len(r["after"]) == 2
        for a, b in zip(r["messages"], r["after"]):
            assert torch.equal(a, b)  # the same int8 shards, bit for bit
        for n, v in r["full"].items():
            assert torch.equal(r["restored"][n], v), n
            assert torch.equal(r["into_plain"][n], v), n
            assert torch.equal(r["nofrozen"][n], v), n
        assert r["resumed"] == r["cont"]


@pytest.mark.parametrize("stage", [1, 2])
def test_needs_stage_3(stage):
    from dsrun.runtime.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="zero_quantized_nontrainable_weights.*need stage 3"):
        load_config({"train_batch_size": 2, "zero_optimization": {
            "stage": stage, "zero_quantized_nontrainable_weights": True}}, world_size=1)


def _rank_with_hpz():
    from tests.dist_helpers import as_nodes
    as_nodes(2)
    out = {}
    for name, zero in (("qnw", {}), ("hpz", {"zero_hpz_partition_size": 2}),
                       ("hpz_qwz", {"zero_hpz_partition_size": 2, "zero_quantized_weights": True})):
        engine, _ = _engine(True, **zero)
        losses = _steps(engine, 3)
        # The secondary covers the trainable buckets: 1/2 of them per rank, fp32.
        trainable = sum(f.trainable_numel for u, f in zip(engine.strategy.units, engine.strategy.sets)
                        if not u.persistent and f.trainable_numel)
        out[name] = (losses, engine.memory_breakdown().get("hpz_secondary"), 4 * trainable // 2)
        if name == "hpz":
            frozen = sum(p.ds_numel for n, p in engine.module.named_parameters() if n.startswith(FROZEN))
            psi = sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)
            est = estimate_zero_memory(psi, 4, 3, "fp32", padded_numel=trainable, hpz_partition_size=2,
                                       frozen_numel=frozen, quantized_nontrainable_weights=True)
            units = sum(1 for f in engine.strategy.sets if f.frozen_block)
            out["estimate"] = (est.categories, engine.memory_breakdown(), units)
    return out


def test_with_hpz_and_qwz():
    """2 nodes x 2 ranks: hpZ in fp32 is exact, so it changes no loss bit;
    with qwZ too the trainable weights' gathers are int8 as well (qwZ's 2%)."""
    res = run_ranks(_rank_with_hpz, 4, timeout=400)[0]
    assert res["hpz"][0] == res["qnw"][0]
    assert res["hpz"][1] == {"fp32": res["hpz"][2]} and res["qnw"][1] is None
    for a, b in zip(res["qnw"][0], res["hpz_qwz"][0]):
        assert abs(a - b) <= 0.02 * abs(a), (res["qnw"][0], res["hpz_qwz"][0])
    # estimate_zero_memory counts the secondary exactly and the int8 frozen shards up to
    # one rounded-up block (256 + 4 bytes) per unit that holds some.
    est, actual, units = res["estimate"]
    assert est["hpz_secondary"] == actual["hpz_secondary"]
    assert 0 <= actual["params"]["int8"] - est["params"]["int8"] <= 260 * units, (est, actual)
    assert est["params"]["fp32"] == actual["params"]["fp32"]


def _rank_modify(offload: str, nvme: str):
    import dsrun
    zero = {"offload_param": {"device": offload, "nvme_path": nvme}} if offload != "none" else {}
    engine, model = _engine(True, **zero)
    plain, _ = _engine(False, **zero)
    first = _steps(engine, 2), _steps(plain, 2)
    wte = model.wte.weight
    before = full_param(engine, wte)
    with dsrun.zero.GatheredParameters([wte], modifier_rank=0):
        with torch.no_grad():
            wte.mul_(0.5)
    halved = full_param(engine, wte)
    _steps(engine, 1, first=2)
    with dsrun.zero.GatheredParameters([wte]):
        gathered = wte.detach().clone()
    return first, before, halved, gathered


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_gathered_parameters_modify_and_param_offload(tmp_path, offload):
    """GatheredParameters(modifier_rank=0) on a frozen weight re-quantizes its
    shards; halving is exact (every block's scale halves, its codes stay),
    so the new values are exactly half the old decoded ones. With parameter
    offload the int8 shards stay in memory beside the offloaded partition."""
    (first, plain), before, halved, gathered = run_ranks(_rank_modify, 2, offload, str(tmp_path), timeout=300)[0]
    for a, b in zip(plain, first):
        assert abs(a - b) <= 5e-3 * abs(a), (plain, first)
    assert torch.equal(halved, before * 0.5)
    assert torch.equal(gathered, halved)  # what a gather decodes after a step


def test_estimate_zero_memory_hpz_and_int8_frozen():
    base = estimate_zero_memory(1000, 4, 3, "bf16")
    hpz = estimate_zero_memory(1000, 4, 3, "bf16", hpz_partition_size=2)
    assert hpz.total - base.total == hpz.categories["hpz_secondary"]["bf16"] == 1000 // 2 * 2
    frozen = estimate_zero_memory(1000, 4, 3, "bf16", frozen_numel=4096)
    int8 = estimate_zero_memory(1000, 4, 3, "bf16", frozen_numel=4096, quantized_nontrainable_weights=True)
    assert frozen.categories["params"]["bf16"] - base.categories["params"]["bf16"] == 1024 * 2
    assert int8.categories["params"] == {"bf16": 250 * 2, "int8": 1024 + 4 * 4}
    for bad in ({"hpz_partition_size": 3}, {"hpz_partition_size": 0}):
        with pytest.raises(ValueError, match="divide"):
            estimate_zero_memory(1000, 4, 3, **bad)
    with pytest.raises(ValueError, match="need stage 3"):
        estimate_zero_memory(1000, 4, 2, hpz_partition_size=2)


def _rank_zero_init():
    import dsrun
    reference, _ = _engine(True)
    with dsrun.zero.Init():
        model = _model()
    cfg = base_config(3, "fp32", stage3_param_persistence_threshold=0, zero_quantized_nontrainable_weights=True)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    shapes = {n: p.ds_shape for n, p in model.named_parameters()}
    engine, *_ = dsrun.initialize(model=model, model_parameters=param_groups(model, shapes=shapes), config=cfg)
    same = all(torch.equal(a.frozen_message, b.frozen_message)
               for a, b in zip(reference.strategy.sets, engine.strategy.sets) if a.frozen_block)
    return same, _steps(reference, 2), _steps(engine, 2)


def test_zero_init_shards_are_quantized_when_adopted():
    """A model built under zero.Init: its frozen shards are quantized as the
    engine adopts them, to the same int8 as a model built whole."""
    same, reference, adopted = run_ranks(_rank_zero_init, 2, timeout=240)[0]
    assert same and adopted == reference

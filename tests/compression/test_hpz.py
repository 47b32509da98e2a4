"""ZeRO++ hpZ (zero_hpz_partition_size): backward all-gathers from a secondary
partition within each node, on 4 ranks as 2 nodes x 2 ranks (gloo).

Expected bytes per step, from the comms logger (comm/logger.py [Note:
intra-node and inter-node bytes]). B = bytes of every unit's gathered
buffer (fp32, padding included; no persistent units here). On 2 "nodes"
the world group has no shared-memory transport, so gloo's all-gathers and
reduce-scatters are all-reduces of the zero-padded region
(zero/collectives.py): 2(p-1)/p x B = 1.5 B of bus bytes over p = 4 ranks,
all of it inter-node.

    plain stage 3:  inter 1.5 B (forward gathers) + 1.5 B (backward) + 1.5 B (gradients) + S, intra 0
    hpZ:            inter 1.5 B + 0 + 1.5 B + S,  intra 0.5 B (backward gathers over 2 ranks)
    hpZ + qwZ:      inter Q + 0 + 1.5 B + S,      intra 0.5 B
    qwZ:            inter 2Q + 1.5 B + S,         intra 0

The intra-node hpZ groups (2 ranks of one node) are served by shared memory,
whose native all-gather moves (2-1)/2 x B; without the native op they would
be gloo's all-reduce of the padded region, 2(2-1)/2 x B = 1.0 B.

S: the two 1-element fp32 all-reduces of a step (loss average, gradient
norm). Q: the int8 forward all-gathers, 3/4 of 4 ranks' messages of
message_numel(B/4/4 elements, 256) bytes per unit. So the weight gathers
that cross nodes fall from 2 x 1.5 B to 1.5 B: the paper's 3M -> 2M per
step with the gradient reduction (Wang et al. 2023, Table 1).
"""
from __future__ import annotations

import pytest
import torch

from dsrun.ops import shm_comm
from dsrun.runtime.comm.quantized import message_numel
from tests.dist_helpers import as_nodes, run_ranks
from tests.zero.models import TinyGPT, base_config, batches, full_param, mean_loss_step, param_groups

QWZ_BLOCK = 256


def _train(cfg: dict, steps: int, modify_at: int | None = None):
    """Train TinyGPT(d=64) with ds_config's AdamW; returns losses, full fp32
    params, the comms counters of the steps after the first (per step), the
    engine. modify_at: before that step, rank 0 scales a block's weight by
    0.5 inside GatheredParameters(modifier_rank=0)."""
    import dsrun
    from dsrun.runtime import comm
    torch.manual_seed(0)
    model = TinyGPT(d=64)
    cfg = {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = dsrun.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    losses = []
    for i, (idx, tgt) in enumerate(batches(comm.get_rank(), steps, 2, 1)):
        if i == 1:
            comm.comms_logger.reset()
        if i == modify_at:
            weight = model.h[1].fc.weight
            with dsrun.zero.GatheredParameters([weight], modifier_rank=0):
                with torch.no_grad():
                    weight.mul_(0.5)
            comm.comms_logger.reset()  # count whole steps only
        losses.append(mean_loss_step(engine, idx, tgt))
    counted = max(1, steps - 1 if modify_at is None else steps - modify_at)
    stats = comm.comms_logger.snapshot()
    per_step = {op: (s.bytes // counted, s.bus_bytes / counted, s.inter_node_bus_bytes / counted)
                for op, s in stats.items()}
    full = {n: full_param(engine, p) for n, p in model.named_parameters()}
    return losses, full, per_step, engine


def _on_two_nodes(precision: str, steps: int):
    as_nodes(2)
    import dsrun
    from dsrun.runtime.config import ConfigError
    zero = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    runs = {"plain": {}, "hpz": {"zero_hpz_partition_size": 2},
            "hpz_qwz": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True},
            "qwz": {"zero_quantized_weights": True}}
    out = {}
    for name, extra in runs.items():
        losses, full, per_step, engine = _train(base_config(3, precision, world_size=4, **zero, **extra), steps)
        units = [u.numel * u.full.element_size() for u in engine.strategy.units]
        out[name] = {"losses": losses, "full": full, "per_step": per_step, "units": units,
                     "memory": engine.memory_breakdown(), "numels": [u.numel for u in engine.strategy.units]}
    try:  # blocks of 4 consecutive ranks would span both nodes
        _train(base_config(3, precision, world_size=4, zero_hpz_partition_size=4), 1)
    except ConfigError as e:
        out["spanning_error"] = str(e)
    dsrun.comm.comms_logger.reset()
    return out


def _inter_intra(per_step: dict) -> tuple[float, float]:
    inter = sum(v[2] for v in per_step.values())
    return inter, sum(v[1] for v in per_step.values()) - inter


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_hpz_matches_plain_stage3_and_keeps_backward_gathers_inside_nodes(precision):
    res = run_ranks(_on_two_nodes, 4, precision, 4, timeout=400)
    r0 = res[0]
    plain, hpz, hpz_qwz, qwz = (r0[k] for k in ("plain", "hpz", "hpz_qwz", "qwz"))
    # hpZ changes where the backward's values come from, not what they are: exact
    assert hpz["losses"] == plain["losses"]
    assert all(torch.equal(hpz["full"][n], plain["full"][n]) for n in plain["full"])
    # with qwZ the secondary keeps the forward's dequantized weights, which a
    # quantized backward gather would rebuild identically: exactly plain qwZ
    assert hpz_qwz["losses"] == qwz["losses"]
    assert all(torch.equal(hpz_qwz["full"][n], qwz["full"][n]) for n in qwz["full"])
    assert plain["losses"][-1] < plain["losses"][0]

    element = 4 if precision == "fp32" else 2
    B = sum(plain["units"])
    S = 2 * 4 * 1.5  # two 1-element fp32 all-reduces over 4 ranks
    Q = sum(3 * message_numel(n // 4, QWZ_BLOCK) for n in plain["numels"])
    intra = 0.5 * B if shm_comm.available() else 1.0 * B
    expected = {"plain": (4.5 * B + S, 0.0), "hpz": (3.0 * B + S, intra),
                "hpz_qwz": (Q + 1.5 * B + S, intra), "qwz": (2 * Q + 1.5 * B + S, 0.0)}
    for rank, r in enumerate(res):
        for name, (inter, intra) in expected.items():
            got = _inter_intra(r[name]["per_step"])
            assert got == pytest.approx((inter, intra), abs=4), (rank, name, got, r[name]["per_step"])
    # the paper's step volume across nodes, weights + gradients: 3 -> 2 (hpZ) parts of 1.5 B
    assert _inter_intra(hpz["per_step"])[0] - S == pytest.approx(2 / 3 * (_inter_intra(plain["per_step"])[0] - S))

    # memory: the secondary partition is 1/2 of every unit (hpZ group of 2), in the compute dtype
    dtype = "fp32" if precision == "fp32" else "bf16"
    assert hpz["memory"]["hpz_secondary"] == {dtype: sum(n // 2 * element for n in plain["numels"])}
    assert "hpz_secondary" not in plain["memory"]
    assert "across two nodes" in r0["spanning_error"] and "zero_hpz_partition_size=4" in r0["spanning_error"]


def _changed_partitions_and_checkpoint(tmp: str, hpz: int, offload: bool):
    as_nodes(2)
    import dsrun
    zero = {"stage3_max_reuse_distance": 0, "zero_hpz_partition_size": hpz}  # default persistence: some persistent
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    cfg = base_config(3, "fp32", world_size=4, **zero)
    losses, full, _, engine = _train(cfg, 5, modify_at=2)
    engine.save_checkpoint(tmp, tag="t")
    more = []
    for idx, tgt in batches(dsrun.comm.get_rank() + 7, 2, 2, 1):
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        more.append(loss.item())
    _, _, _, again = _train(cfg, 1)
    again.load_checkpoint(tmp, tag="t")
    resumed = []
    for idx, tgt in batches(dsrun.comm.get_rank() + 7, 2, 2, 1):
        loss = again(idx, tgt)
        again.backward(loss)
        again.step()
        resumed.append(loss.item())
    persistent = any(u.persistent for u in engine.strategy.units)
    return losses, more, resumed, persistent


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True])
def test_hpz_after_gathered_parameters_and_checkpoint_load_equals_plain(tmp_path, offload):
    """A parameter changed by GatheredParameters and a checkpoint load make the
    secondary stale: the next backward must see the new values."""
    plain = run_ranks(_changed_partitions_and_checkpoint, 4, str(tmp_path / "plain"), 1, offload, timeout=500)
    hpz = run_ranks(_changed_partitions_and_checkpoint, 4, str(tmp_path / "hpz"), 2, offload, timeout=500)
    for p, h in zip(plain, hpz):
        assert h[3]  # persistent units and hpZ units side by side
        assert h[0] == p[0]  # losses, the modification included
        assert h[1] == p[1] and h[2] == p[1]  # after a load, as if never saved


def test_hpz_config_errors():
    from dsrun.runtime.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="needs stage 3"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}},
                    world_size=4)
    with pytest.raises(ConfigError, match="zero_hpz_partition_size=3 does not divide the world size 4"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}},
                    world_size=4)
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
                      world_size=4)
    assert cfg.zero_optimization.zero_hpz_partition_size == 2

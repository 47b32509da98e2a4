"""ZeRO++ hpZ and qgZ on the mesh's ZeRO axis, so they combine with tensor
and sequence parallelism: both split ZeRO's group (the "data" axis, or
"sequence_data" under sequence parallelism) with ParallelMesh.data_blocks,
not the whole job.

4 gloo ranks on one node (but one test). Tensor 2 x data 2 (AutoTP on test_autotp's tiny
Llama, ZeRO-3): hpZ's group is the two data ranks holding the same tensor
shard, and the run equals the same run without hpZ (fp32, 1e-5: hpZ
gathers the same values from another copy); qgZ quantizes the gradients to
int4, so it is held to test_qgz.py's bounds against its own unquantized run.
As 2 nodes x 2 ranks, qgZ's node grid follows the data groups across the
nodes, and hpZ's blocks, which would span them, are refused.
Sequence 2 x data 2 (test_ulysses's block, ZeRO-3): hpZ over
"sequence_data" equals the run without it and one process."""
from __future__ import annotations

import torch

from tests.dist_helpers import as_nodes, run_ranks, train_steps
from tests.parallel.test_autotp import STEPS, TOL, _build, _config, _ids, _lm_loss


def _train_tp(zero: dict) -> tuple[list[float], list[float], list[int] | None]:
    """STEPS steps of Llama at tensor 2 x data 2, ZeRO-3 with `zero` added
    to zero_optimization; 8 samples per step. Returns (mean loss, global
    gradient norm) per step and the global ranks of the hpZ group (None
    without hpZ)."""
    import torch.distributed as dist

    import dsrun
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = _config(3, 4, autotp=2)
    cfg["zero_optimization"].update(zero, stage3_param_persistence_threshold=0)
    engine, *_ = dsrun.initialize(model=_build("llama"), config=cfg)
    hpz = engine.strategy.hpz
    hpz_ranks = None if hpz is None else dist.get_process_group_ranks(hpz.group)
    assert hpz is None or hpz_ranks == list(engine.mesh.ranks("data"))
    secondary = [u.secondary for u in engine.strategy.units if u.secondary is not None]
    assert (hpz is not None) == bool(secondary)  # every unit keeps its hpZ copy
    data_rank = rank // 2  # data x model: the model axis is innermost
    batch = _ids(100, batch=8)[data_rank * 4:(data_rank + 1) * 4]
    losses, norms = train_steps(engine, STEPS, lambda _: _lm_loss("llama", engine, batch))
    engine.destroy()
    return losses, norms, hpz_ranks


def _tp_runs():
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    dsrun.init_distributed()
    out = {}
    for name, zero in (("plain", {}), ("hpz", {"zero_hpz_partition_size": 2}),
                       ("qgz", {"zero_quantized_gradients": True})):
        out[name] = _train_tp(zero)
        set_current(None)
    from dsrun.runtime.config import ConfigError
    try:  # 4 divides the job, not the data axis
        _train_tp({"zero_hpz_partition_size": 4})
    except ConfigError as e:
        out["error"] = str(e)
    return out


def test_hpz_and_qgz_with_tensor_parallelism():
    results = run_ranks(_tp_runs, 4, timeout=400)
    plain, hpz, qgz = (results[0][k] for k in ("plain", "hpz", "qgz"))
    assert [r["hpz"][2] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # the data axis, not the world
    # the config check, before any collective: its "world size" is the data-parallel one (of the batch)
    assert "zero_hpz_partition_size=4 does not divide the world size 2" in results[0].get("error", "")
    torch.testing.assert_close(torch.tensor(hpz[0]), torch.tensor(plain[0]), **TOL)
    torch.testing.assert_close(torch.tensor(hpz[1]), torch.tensor(plain[1]), **TOL)
    assert plain[0][-1] < plain[0][0]  # it trains
    # qgZ: the same weights until the first step; then test_qgz.py's bounds (4.5% per step)
    assert qgz[0][0] == plain[0][0]
    for a, b in zip(plain[0], qgz[0]):
        assert abs(a - b) <= 0.045 * abs(a), (plain[0], qgz[0])
    assert qgz[0][-1] < qgz[0][0]


def _tp_on_two_nodes():
    """Tensor 2 x data 2 as 2 nodes x 2 ranks: each data group {0, 2},
    {1, 3} has one rank per node, so qgZ's first all-to-all is within a rank
    alone and the second crosses nodes; hpZ's block of 2 would span them."""
    as_nodes(2)
    import dsrun
    from dsrun.runtime.config import ConfigError
    from dsrun.runtime.parallel.mesh import set_current
    dsrun.init_distributed()
    plain = _train_tp({})
    set_current(None)
    qgz = _train_tp({"zero_quantized_gradients": True})
    set_current(None)
    try:
        _train_tp({"zero_hpz_partition_size": 2})
    except ConfigError as e:
        return plain, qgz, str(e)
    return plain, qgz, None


def test_qgz_across_nodes_and_hpz_spanning_nodes_with_tensor_parallelism():
    plain, qgz, error = run_ranks(_tp_on_two_nodes, 4, timeout=400)[0]
    assert qgz[0][0] == plain[0][0]
    for a, b in zip(plain[0], qgz[0]):
        assert abs(a - b) <= 0.045 * abs(a), (plain[0], qgz[0])
    assert qgz[0][-1] < qgz[0][0]
    assert error is not None and "ranks [0, 2] would form one hpZ group across two nodes" in error, error


def _sequence_runs():
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    from tests.parallel.test_ulysses import _train
    dsrun.init_distributed()
    out = {}
    for name, zero in (("plain", {}), ("hpz", {"zero_hpz_partition_size": 2}),
                       ("hpz4", {"zero_hpz_partition_size": 4})):  # 4 > the data axis: blocks of data x sequence
        out[name] = _train(2, stage=3, zero=zero)
        set_current(None)
    return out


def _one_process():
    import dsrun
    from tests.parallel.test_ulysses import _train
    dsrun.init_distributed()
    return _train(1, stage=3)


def test_hpz_with_sequence_parallelism_equals_plain_and_one_process():
    want_loss, want_params = run_ranks(_one_process, 1, timeout=120)[0]
    results = run_ranks(_sequence_runs, 4, timeout=300)
    plain_loss, plain_params = results[0]["plain"]
    for key in ("hpz", "hpz4"):
        loss, params = results[0][key]
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(plain_loss), **TOL, msg=key)
        torch.testing.assert_close(params, plain_params, **TOL, msg=key)
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), **TOL, msg=key)
        torch.testing.assert_close(params, want_params, **TOL, msg=key)

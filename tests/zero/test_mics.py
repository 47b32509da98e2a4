"""MiCS (zero_optimization.mics_shard_size) at 4 gloo ranks on two "nodes"
of 2 ranks (tests.dist_helpers.as_nodes): with a shard size of 2, stage 3
(and stage 2) train to the same losses and weights as plain ZeRO over the 4
ranks, every parameter all-gather stays inside a node, per the comms
logger's node accounting, and only the gradient all-reduce across the
blocks crosses nodes.

Tolerance: MiCS sums a gradient inside each block, then across the blocks;
plain ZeRO sums the 4 ranks at once: the same numbers added in another
order, 1e-5 relative on losses and weights after 3 AdamW steps."""
import pytest
import torch

from dsrun.runtime import config as config_module
from tests.dist_helpers import as_nodes, run_ranks
from tests.zero.models import TinyGPT, base_config, batches, full_param, mean_loss_step, param_groups


def _train(config: dict, steps: int = 3):
    """TinyGPT trained on this rank's batches; (losses, full weights, the
    collectives of the training steps alone, the ZeRO group sizes)."""
    import dsrun
    from dsrun.runtime import comm

    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=1e-2),
                                  config=config)
    comm.comms_logger.reset()  # initialize's own collectives (the ranks' agreement) are not the steps'
    losses = [mean_loss_step(engine, idx, tgt) for idx, tgt in batches(comm.get_rank(), steps, 2, 2)]
    stats = engine.comm_stats()
    full = {n: full_param(engine, p) for n, p in model.named_parameters()}
    groups = engine.strategy.groups
    engine.destroy()
    return losses, full, stats, (groups.shard.size, groups.replicate.size)


def _rank(stages):
    as_nodes(2)
    from dsrun.runtime.zero import collectives

    # Gather with all-gathers, as on NCCL (gloo's fastest gather is an
    # all-reduce, which would mix the gathers with the gradient all-reduce
    # in the counters).
    collectives.uses_all_reduce = lambda group: False
    out = {}
    for stage in stages:
        for mics in (-1, 2):
            cfg = base_config(stage, gas=2, reduce_bucket_size=500, allgather_bucket_size=1000,
                              stage3_param_persistence_threshold=0, mics_shard_size=mics)
            losses, full, stats, groups = _train(cfg)
            out[(stage, mics)] = {"losses": losses, "full": full, "groups": groups,
                                  "gather": stats["all_gather_into_tensor"], "all_reduce": stats["all_reduce"]}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 4, (2, 3), timeout=300)


@pytest.mark.parametrize("stage", [2, 3])
def test_mics_trains_as_plain_zero(results, stage):
    for rank in results:
        plain, mics = rank[(stage, -1)], rank[(stage, 2)]
        assert plain["groups"] == (4, 1) and mics["groups"] == (2, 2)
        torch.testing.assert_close(torch.tensor(mics["losses"]), torch.tensor(plain["losses"]),
                                   rtol=1e-5, atol=0)
        for name, value in plain["full"].items():
            torch.testing.assert_close(mics["full"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_gathers_stay_inside_the_shard_group(results, stage):
    for rank in results:
        plain, mics = rank[(stage, -1)], rank[(stage, 2)]
        assert plain["gather"].calls > 0 and plain["gather"].inter_node_bus_bytes > 0  # the detector works
        assert mics["gather"].calls > 0 and mics["gather"].inter_node_bus_bytes == 0
        # a gather over 2 ranks sends half of its message, over 4 ranks three quarters
        assert mics["gather"].bus_bytes < plain["gather"].bus_bytes
        assert mics["all_reduce"].inter_node_bus_bytes > 0  # gradients cross the blocks


def test_a_shard_size_that_does_not_divide_the_world_is_an_error():
    import dsrun

    model = torch.nn.Linear(3, 1)
    with pytest.raises(config_module.ConfigError, match="mics_shard_size=2 does not divide the data-parallel size 1"):
        dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         config=base_config(3, mics_shard_size=2))


def test_a_model_built_under_zero_init_is_refused():
    """zero.Init partitions over every rank, not over MiCS's blocks: a clear error, not a shape mismatch."""
    import dsrun

    with dsrun.zero.Init():
        model = torch.nn.Linear(3, 1)
    with pytest.raises(config_module.ConfigError, match="parameter weight was built under zero.Init"):
        dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         config=base_config(3, mics_shard_size=1))

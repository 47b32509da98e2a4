"""TiledLinear: DeepSpeed's tiling arguments, the same function as one linear
layer, and under stage 3 one tile gathered at a time (a layer bigger than
stage3_max_live_parameters still runs)."""
import pytest
import torch

import dsrun
from dsrun.runtime.zero.tiling import TiledLinear, split_points
from tests.dist_helpers import run_ranks


def test_split_points_follow_deepspeed():
    assert split_points(10, 3) == [0, 4, 7, 10]
    assert split_points(2, 4) == [0, 1, 2, 2, 2]
    assert split_points(8, 1) == [0, 8]


@pytest.mark.parametrize("in_splits,out_splits", [(1, 1), (3, 1), (1, 4), (3, 4)])
def test_same_function_as_linear(in_splits, out_splits):
    torch.manual_seed(0)
    ref = torch.nn.Linear(10, 13)
    tiled = TiledLinear(10, 13, in_splits=in_splits, out_splits=out_splits, init_linear=ref)
    x = torch.randn(2, 5, 10, requires_grad=True)
    torch.testing.assert_close(tiled(x), ref(x))
    assert len(tiled.linears) == out_splits and all(len(r) == in_splits for r in tiled.linears)
    biases = [t.bias is not None for row in tiled.linears for t in row]
    assert sum(biases) == out_splits  # one bias per output part, in its last tile
    parts = tiled.linears[0][0]
    assert isinstance(parts, torch.nn.Linear)


def test_split_input_and_uncombined_output():
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 4, bias=False)
    tiled = TiledLinear(6, 4, bias=False, in_splits=2, out_splits=2, input_is_already_split=True,
                        combine_out_splits=False, init_linear=ref)
    x = torch.randn(3, 6)
    outs = tiled(list(torch.split(x, 3, dim=-1)))
    torch.testing.assert_close(torch.cat(outs, -1), ref(x))
    with pytest.raises(ValueError, match="in 2 parts"):
        tiled([x])
    with pytest.raises(ValueError, match="in_splits"):
        TiledLinear(4, 4, in_splits=5)


def _stage3_tiles():
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 96)
    model = TiledLinear(64, 96, in_splits=2, out_splits=3, init_linear=ref)
    tile = 32 * 32
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": tile + 32, "stage3_prefetch_bucket_size": 0,
                                 "stage3_max_reuse_distance": 0}}
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    live = []
    for row in model.linears:
        for t in row:
            t.register_forward_hook(lambda m, a, o: live.append(engine.strategy.gathered_numel()))
    x = torch.randn(2, 64)
    losses = []
    for _ in range(2):
        out = engine(x)
        loss = out.square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for _ in range(2):
        loss = ref(x).square().mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    return losses, ref_losses, max(live), len(engine.strategy.units)


def test_stage3_gathers_one_tile_at_a_time():
    for losses, ref_losses, max_live, units in run_ranks(_stage3_tiles, 2, timeout=120):
        assert units >= 6  # every tile is a unit of its own
        assert max_live <= 32 * 32 + 32  # never more than one tile (weight + bias) gathered
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert 64 * 96 > 32 * 32 + 32  # the whole layer would not fit the live limit


def test_exported_as_deepspeed_names():
    assert dsrun.zero.TiledLinear is TiledLinear

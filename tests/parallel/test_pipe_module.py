"""PipelineModule: partitioning, per-rank building, forward composition, tied
layers and activation checkpointing, single process. Each stage is built by
passing a topology whose get_coord gives that stage."""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dsrun.runtime import comm
from dsrun.runtime.activation_checkpointing import checkpointing
from dsrun.runtime.parallel.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec, TiedWeightGroup
from dsrun.runtime.parallel.pipe.partition import partition_balanced, partition_uniform
from dsrun.runtime.utils import set_random_seed


class PipeTopology:
    """The duck-typed topology: `num_stages` stages, this rank on `stage`."""

    def __init__(self, num_stages: int, stage: int):
        self.num_stages, self.stage = num_stages, stage

    def get_dim(self, axis: str) -> int:
        return self.num_stages if axis == "pipe" else 1

    def get_coord(self, rank: int):
        return SimpleNamespace(pipe=self.stage, data=0)


class Block(nn.Module):
    """A layer that records where it was constructed (meta or a real device)."""

    built_on: list[str] = []

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        Block.built_on.append(self.fc.weight.device.type)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def double(x):
    return x * 2


GELU = nn.GELU()  # one instance, given directly


def mixed_specs():
    """8 layers: specs of two kinds, a module instance and a function."""
    return [LayerSpec(nn.Linear, 6, 12), LayerSpec(Block, 12), LayerSpec(nn.Linear, 12, 5), double,
            LayerSpec(Block, 5), GELU, LayerSpec(nn.Linear, 5, 7, bias=False), LayerSpec(Block, 7)]


def reference(specs, base_seed=1234):
    """nn.Sequential of the same layers, layer i built after seeding with base_seed + i."""
    layers = []
    for i, spec in enumerate(specs):
        set_random_seed(base_seed + i)
        if isinstance(spec, LayerSpec):
            layers.append(spec.build())
        elif isinstance(spec, nn.Module):
            layers.append(spec)
        else:
            layers.append(Lambda(spec))
    return nn.Sequential(*layers)


def build_stages(specs, p, **kwargs):
    return [PipelineModule(specs, topology=PipeTopology(p, s), **kwargs) for s in range(p)]


def run_pipeline(stages, x):
    """The model's forward: every part in order, on the rank and chunk that holds it."""
    p, v = len(stages), stages[0].virtual_stages
    for part in range(p * v):
        x = stages[part % p](x, chunk=part // p)
    return x


# -- partitioning --------------------------------------------------------------------------


def test_partition_uniform_gives_the_first_parts_the_extra_items():
    assert partition_uniform(10, 3) == [0, 4, 7, 10]
    assert partition_uniform(3, 3) == [0, 1, 2, 3]


def test_partition_balanced_reaches_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        m = rng.randint(1, n)
        weights = [rng.choice([0, 0, 1, 3, 10, 50]) for _ in range(n)]
        parts = partition_balanced(weights, m)
        assert len(parts) == m + 1 and parts[0] == 0 and parts[-1] == n
        assert all(a < b for a, b in itertools.pairwise(parts)), (weights, m, parts)
        best = min(max(sum(weights[a:b]) for a, b in zip((0, *cut), (*cut, n)))
                   for cut in itertools.combinations(range(1, n), m - 1))
        assert max(sum(weights[a:b]) for a, b in itertools.pairwise(parts)) == best, (weights, m, parts)


def test_partition_rejects_more_parts_than_items_and_bad_weights():
    with pytest.raises(ValueError, match="at least one layer"):
        partition_uniform(2, 3)
    with pytest.raises(ValueError, match="at least one layer"):
        partition_balanced([1, 2], 3)
    with pytest.raises(ValueError, match="non-negative integers"):
        partition_balanced([1, -2, 3], 2)


# -- building and forward ------------------------------------------------------------------


@pytest.mark.parametrize("method", ["parameters", "uniform", "type:block"])
@pytest.mark.parametrize("p,v", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (3, 2)])
def test_stages_compose_to_the_sequential_model_bit_for_bit(p, v, method):
    specs = mixed_specs()
    stages = build_stages(specs, p, seed_layers=True, partition_method=method, virtual_stages=v)
    x = torch.randn(3, 6)
    assert torch.equal(run_pipeline(stages, x), reference(specs)(x))
    assert len(stages[0].parts) == p * v + 1
    held = sorted(idx for stage in stages for idx, _ in stage.local_layers())
    assert held == list(range(len(specs)))  # every layer on exactly one rank
    for stage in stages:
        for k in range(v):
            part = stage.stage_id + k * p
            assert [i for i, _ in stage.local_layers(k)] == list(range(stage.parts[part], stage.parts[part + 1]))


def test_state_dict_keys_and_values_do_not_depend_on_the_partitioning():
    specs = mixed_specs()
    whole = PipelineModule(specs, num_stages=1, seed_layers=True).state_dict()
    for p, v in [(2, 1), (2, 2), (3, 1)]:
        merged = {}
        for stage in build_stages(specs, p, seed_layers=True, virtual_stages=v, partition_method="uniform"):
            merged.update(stage.state_dict())
        assert merged.keys() == whole.keys()
        assert all(torch.equal(merged[k], whole[k]) for k in whole)
    assert "0.weight" in whole and "6.weight" in whole
    assert PipelineModule.layer_checkpoint_name(3) == "layer_03-model_states.pt"
    assert PipelineModule.layer_checkpoint_name(12, "model_01") == "layer_12-model_01-model_states.pt"


@pytest.mark.parametrize("method", ["parameters", "uniform"])
def test_each_rank_builds_only_its_own_layers(method):
    specs = [LayerSpec(Block, 4) for _ in range(6)] + [GELU]
    Block.built_on.clear()
    stage = PipelineModule(specs, topology=PipeTopology(3, 1), partition_method=method)
    mine = stage.local_layers()
    assert [d for d in Block.built_on if d != "meta"] == ["cpu"] * len(mine)
    assert len(Block.built_on) == len(mine) + (len(specs) - 1 if method == "parameters" else 0)
    last = PipelineModule(specs, topology=PipeTopology(3, 2), partition_method=method)
    assert GELU not in dict(stage.named_children()).values()
    assert GELU in dict(last.named_children()).values()


def test_parameters_partitioning_balances_a_skewed_model():
    specs = [LayerSpec(nn.Linear, 64, 64)] + [LayerSpec(nn.Linear, 4, 4) for _ in range(6)]
    assert PipelineModule(specs, num_stages=1, partition_method="uniform").parts == [0, 7]
    stages = build_stages(specs, 2, partition_method="parameters")
    assert stages[0].parts == [0, 1, 7]
    assert [sum(q.numel() for q in s.parameters()) for s in stages] == [64 * 65, 6 * 20]
    assert build_stages(specs, 2, partition_method="uniform")[0].parts == [0, 4, 7]


def test_type_partitioning_balances_matching_layers_case_insensitively():
    specs = [LayerSpec(nn.Linear, 4, 4)] + [LayerSpec(Block, 4) for _ in range(4)] + [double, double, double]
    parts = PipelineModule(specs, topology=PipeTopology(2, 0), partition_method="type:BLO.K").parts
    assert [sum(isinstance(specs[i], LayerSpec) and specs[i].typename is Block for i in range(a, b))
            for a, b in itertools.pairwise(parts)] == [2, 2]
    # functions match by their own name
    assert PipelineModule(specs, topology=PipeTopology(3, 0), partition_method="type:^double$").parts == [0, 6, 7, 8]
    with pytest.raises(ValueError, match="no layer's class name matches"):
        PipelineModule(specs, num_stages=1, partition_method="type:Conv")


def test_a_stage_without_parameters_works():
    specs = [LayerSpec(nn.Linear, 4, 4), double]
    stages = build_stages(specs, 2, seed_layers=True, partition_method="uniform")
    assert list(stages[1].parameters()) == []
    x = torch.randn(2, 4)
    assert torch.equal(run_pipeline(stages, x), reference(specs)(x))


def test_a_tuple_output_reaches_the_next_layer_as_one_argument():
    seen = []

    def split(x):
        return x, x + 1

    def join(pair):
        seen.append(type(pair))
        a, b = pair
        return a * b

    for interval in (0, 1):
        m = PipelineModule([LayerSpec(nn.Linear, 3, 3), split, join], num_stages=1, partition_method="uniform",
                           activation_checkpoint_interval=interval)
        x = torch.randn(2, 3)
        y = m.get_submodule("0")(x)
        assert torch.equal(m(x), y * (y + 1))
    assert seen == [tuple, tuple]


# -- tied layers ---------------------------------------------------------------------------


def tied_specs():
    return [TiedLayerSpec("embed", nn.Linear, 4, 4, bias=False), LayerSpec(Block, 4), LayerSpec(Block, 4),
            TiedLayerSpec("embed", nn.Linear, 4, 4, bias=False, forward_fn=lambda m, x: x @ m.weight)]


def tied_reference(x):
    set_random_seed(1234)
    embed = nn.Linear(4, 4, bias=False)
    set_random_seed(1235)
    b1 = Block(4)
    set_random_seed(1236)
    b2 = Block(4)
    return b2(b1(embed(x))) @ embed.weight


def test_tied_layers_on_one_rank_share_one_module():
    for v in (1, 2):
        m = PipelineModule(tied_specs(), num_stages=1, seed_layers=True, partition_method="uniform",
                           virtual_stages=v)
        assert list(m.tied_modules) == ["embed"]
        assert sum(q.numel() for q in m.parameters()) == 16 + 2 * 20
        assert m.tied_keys() == ["embed"] and m.tied_stages("embed") == [0]
        assert m.tied_weight_broadcast_plan() == []
        x = torch.randn(2, 4)
        assert torch.equal(run_pipeline([m], x), tied_reference(x))


def test_tied_stages_and_the_broadcast_plan_across_stages():
    stages = build_stages(tied_specs(), 2, seed_layers=True, partition_method="uniform")
    assert stages[0].parts == [0, 2, 4]
    assert [s.tied_stages("embed") for s in stages] == [[0, 1], [0, 1]]
    plan = stages[1].tied_weight_broadcast_plan()
    assert plan == [TiedWeightGroup("embed", (0, 1), 0, ("weight",))]
    assert stages[1].tied_parameters("embed") == [stages[1].tied_modules["embed"].weight]
    assert [q.ds_pipe_replicated for q in stages[0].tied_modules["embed"].parameters()] == [False]
    assert [q.ds_pipe_replicated for q in stages[1].tied_modules["embed"].parameters()] == [True]
    # what the engine's start-up broadcast does: the lowest stage's weights everywhere
    with torch.no_grad():
        stages[1].tied_parameters("embed")[0].copy_(stages[0].tied_parameters("embed")[0])
    x = torch.randn(2, 4)
    assert torch.equal(run_pipeline(stages, x), tied_reference(x))

    three = build_stages(tied_specs(), 3, partition_method="uniform")
    assert three[0].parts == [0, 2, 3, 4] and three[0].tied_stages("embed") == [0, 2]
    with pytest.raises(ValueError, match="held by stages \\[0, 2\\]"):
        three[1].tied_parameters("embed")
    with pytest.raises(KeyError, match="no tied layer has key 'head'"):
        three[0].tied_stages("head")


# -- activation checkpointing --------------------------------------------------------------


def dropout_specs():
    return [LayerSpec(nn.Linear, 5, 8), LayerSpec(nn.Dropout, 0.5), LayerSpec(Block, 8), double,
            LayerSpec(nn.Dropout, 0.3), LayerSpec(nn.Linear, 8, 2)]


def loss_and_grads(module, x):
    module.train()
    out = module(x)
    out.square().sum().backward()
    return out.detach(), {k: q.grad.clone() for k, q in module.named_parameters()}


@pytest.mark.parametrize("interval", [1, 2, 4])
def test_activation_checkpointing_keeps_outputs_and_gradients(interval):
    calls = []

    def counting_checkpoint(function, *args):
        calls.append(len(args))
        return checkpointing.checkpoint(function, *args)

    x = torch.randn(4, 5)
    plain = loss_and_grads(PipelineModule(dropout_specs(), num_stages=1, seed_layers=True), x)
    ckpt_module = PipelineModule(dropout_specs(), num_stages=1, seed_layers=True,
                                 activation_checkpoint_interval=interval,
                                 activation_checkpoint_func=counting_checkpoint)
    ckpt = loss_and_grads(ckpt_module, x)
    assert torch.equal(plain[0], ckpt[0])
    assert plain[1].keys() == ckpt[1].keys() and all(torch.equal(plain[1][k], ckpt[1][k]) for k in plain[1])
    # DeepSpeed's rule: a segment is checkpointed when one of its layers has parameters
    segments = [dropout_specs()[i:i + interval] for i in range(0, 6, interval)]
    assert len(calls) == sum(any(s.typename in (nn.Linear, Block) for s in seg if isinstance(s, LayerSpec))
                             for seg in segments)
    calls.clear()
    ckpt_module.eval()
    ckpt_module(x)
    assert calls == []  # not in evaluation


def test_checkpointable_layers_limits_which_segments_are_checkpointed():
    calls = []

    def counting_checkpoint(function, *args):
        calls.append(None)
        return checkpointing.checkpoint(function, *args)

    m = PipelineModule(dropout_specs(), num_stages=1, activation_checkpoint_interval=1,
                       activation_checkpoint_func=counting_checkpoint, checkpointable_layers=["Block", "Dropout"])
    m.train()
    m(torch.randn(3, 5))
    assert len(calls) == 3  # Dropout, Block, Dropout; not the Linears nor the function



class ParallelTransformerLayerPipe(Block):
    pass


class GPTModelPipe(PipelineModule):
    pass


def test_gpt_pipes_with_a_reentrant_function_checkpoint_only_transformer_layers():
    calls = []

    def reentrant_checkpoint(function, *args):
        calls.append(None)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)

    specs = [LayerSpec(nn.Linear, 4, 4), LayerSpec(ParallelTransformerLayerPipe, 4), LayerSpec(Block, 4)]
    for checkpointable, expected in [(None, 1), (["Block"], 2)]:
        calls.clear()
        m = GPTModelPipe(specs, num_stages=1, activation_checkpoint_interval=1, checkpointable_layers=checkpointable,
                         activation_checkpoint_func=reentrant_checkpoint)
        m.train()
        m(torch.randn(2, 4, requires_grad=True))
        assert len(calls) == expected

def test_dropout_draws_the_same_masks_however_the_model_is_split():
    x = torch.randn(4, 5)
    outs = []
    for p, v in [(1, 1), (2, 1), (3, 2)]:
        stages = build_stages(dropout_specs(), p, seed_layers=True, partition_method="uniform", virtual_stages=v)
        for s in stages:
            s.train()
        outs.append([run_pipeline(stages, x), run_pipeline(stages, x)])
    assert not torch.equal(outs[0][0], outs[0][1])  # a new mask on the next forward
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)


# -- stages from the rank, accessors, errors -----------------------------------------------


def test_without_topology_the_stage_is_pipe_outermost(monkeypatch):
    monkeypatch.setattr(comm, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(comm, "get_rank", lambda group=None: 5)
    m = PipelineModule(mixed_specs(), num_stages=2, virtual_stages=2, loss_fn=nn.MSELoss())
    assert (m.num_stages, m.stage_id, m.virtual_stages, m.num_pipeline_stages()) == (2, 1, 2, 2)
    assert m.topology() is None and isinstance(m.loss_fn, nn.MSELoss)
    assert not m.is_first_stage(0) and not m.is_last_stage(0) and m.is_last_stage(1) and m.is_last_stage()
    assert m.stage_owner(m.parts[1]) == 1 and m.stage_owner(m.parts[2]) == 0
    monkeypatch.setattr(comm, "get_rank", lambda group=None: 3)
    first = PipelineModule(mixed_specs(), num_stages=2, virtual_stages=2)
    assert first.stage_id == 0 and first.is_first_stage() and not first.is_first_stage(1)
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        PipelineModule(mixed_specs(), num_stages=3)


def test_layer_spec_repr_and_build():
    spec = LayerSpec(nn.Linear, 3, 4, bias=False)
    assert repr(spec) == "Linear(3, 4, bias=False)"
    layer = spec.build()
    assert isinstance(layer, nn.Linear) and layer.bias is None
    assert TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr="bias").tied_weight_attr == ["bias"]
    assert TiedLayerSpec("k", nn.Linear, 2, 2).tied_weight_attr == ["weight"]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(), ValueError, "needs num_stages or topology"),
    (dict(num_stages=3, topology=PipeTopology(2, 0)), ValueError, "topology has 2 pipeline stages"),
    (dict(num_stages=0), ValueError, "must be an integer >= 1"),
    (dict(topology=PipeTopology(2, 2)), ValueError, "outside 0..1"),
    (dict(num_stages=1, virtual_stages=0), ValueError, "virtual_stages=0"),
    (dict(num_stages=1, activation_checkpoint_interval=-1), ValueError, "activation_checkpoint_interval=-1"),
    (dict(num_stages=1, partition_method="manual:0,4"), ValueError, "use 'parameters', 'uniform'"),
    (dict(topology=PipeTopology(3, 0), virtual_stages=3), ValueError, "8 layers into 9 parts"),
    (dict(num_stages=1, checkpointable_layers="Block"), TypeError, "list of layer class names"),
])
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        PipelineModule(mixed_specs(), **kwargs)


def test_bad_layers_and_chunks_raise_clear_errors():
    with pytest.raises(TypeError, match="must be an nn.Module subclass"):
        LayerSpec(double)
    with pytest.raises(TypeError, match="layer 1 is 3"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2), 3], num_stages=1)
    inner = PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1)
    with pytest.raises(TypeError, match="nesting them is not supported"):
        PipelineModule([inner], num_stages=1)
    with pytest.raises(ValueError, match="chunks 0..0"):
        inner(torch.randn(1, 2), chunk=1)


def test_seed_fn_gets_deepspeeds_seeds_when_building_and_in_forward():
    seeds = []
    stage = PipelineModule(mixed_specs(), topology=PipeTopology(2, 1), seed_layers=True, seed_fn=seeds.append,
                           base_seed=100, partition_method="uniform", activation_checkpoint_interval=2)
    assert seeds == [104, 105, 106, 107]  # base_seed + global layer index, before each build
    seeds.clear()
    stage.train()
    stage(torch.randn(2, 5))
    stage(torch.randn(2, 5))
    # forward call c (1, 2, ...) seeds layer idx with base_seed * (c + 1) + idx, also in checkpointed segments
    assert seeds == [204, 205, 206, 207, 304, 305, 306, 307]

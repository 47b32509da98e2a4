"""OrderedReducer on one rank, no process group (see [Note: ordered reduction] in zero/reducer.py).

With a shard and a replicate group of one rank each, `reduce_region`
communicates nothing and the data-parallel size is 1, so the averaged
gradient shard must equal the gradients themselves: what is left to check
is the reducer's own logic -- launch order, when a region launches, the
in-flight bound, staging buffers, accumulation across backwards and
micro-batches, unused parameters and the communication dtype.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from dsrun.runtime.optim.precision import PrecisionPolicy
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.groups import RankGroup, ZeroGroups
from dsrun.runtime.zero.reducer import OrderedReducer, Region

# Bucket size 20: buckets {a}, {b}, {c, d} (15, 7 and 16 + 3 elements).
SHAPES = [(5, 3), (7,), (4, 4), (3,)]
ALONE = ZeroGroups(RankGroup.alone(), RankGroup.alone())


def _setup(precision: PrecisionPolicy | None = None, in_place: bool = False, reverse: bool = False):
    """Parameters, their FlatParamSet, one region per bucket (in launch order) and a reducer
    recording the bucket index of every region it launches."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    fset = FlatParamSet("group0", [(p, f"p{i}", 0) for i, p in enumerate(params)], RankGroup.alone(),
                        precision or PrecisionPolicy(), 20, partition_params=False, grad_in_full=in_place)
    regions = [Region(fset, [b], in_place=in_place) for b in fset.layout.buckets]
    if reverse:
        regions.reverse()
    launched: list[int] = []
    reducer = OrderedReducer(regions, ALONE, on_launched=lambda r: launched.append(r.buckets[0].index))
    return params, fset, regions, reducer, launched


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _flat(fset: FlatParamSet, grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients in the set's flat layout (padding zero), fp32."""
    out = torch.zeros(fset.layout.padded_numel)
    for slot, g in zip(fset.layout.slots, grads):
        out[slot.offset:slot.offset + slot.numel] = g.reshape(-1)
    return out


def _backward(reducer: OrderedReducer, params, grads, order=None, launch: bool = True, flush: bool = True):
    """What a backward does: begin, one hook call per parameter (in `order`), flush."""
    reducer.begin(launch=launch)
    for i in (range(len(params)) if order is None else order):
        params[i].grad = grads[i].clone()
        reducer.accumulate(params[i])
    if flush:
        reducer.flush()


def test_layout_of_the_fixture():
    _, fset, regions, _, _ = _setup()
    assert [len(fset.layout.slots_of_bucket(b.index)) for b in fset.layout.buckets] == [1, 1, 2]
    assert [r.slots[0].index for r in regions] == [0, 1, 2]


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_regions_launch_in_the_fixed_order_whatever_the_hook_order(order):
    params, fset, _regions, reducer, launched = _setup()
    grads = _grads(1)
    _backward(reducer, params, grads, order, flush=False)
    assert launched == [0, 1, 2]  # complete regions only, never ahead of an earlier one
    reducer.flush()
    assert launched == [0, 1, 2]
    assert torch.equal(fset.grad_partition, _flat(fset, grads))
    assert all(p.grad is None for p in params)  # the staging buffer took each gradient


def test_the_list_order_is_the_launch_order():
    """stage12.py lists regions in reverse (backward produces gradients roughly last layer first)."""
    params, _fset, _regions, reducer, launched = _setup(reverse=True)
    reducer.begin(launch=True)
    params[0].grad = torch.ones(SHAPES[0])
    reducer.accumulate(params[0])
    assert launched == []  # bucket 0 is complete but comes last
    for i in (3, 2):
        params[i].grad = torch.ones(SHAPES[i])
        reducer.accumulate(params[i])
    assert launched == [2]  # the region of c and d is complete once both arrived
    params[1].grad = torch.ones(SHAPES[1])
    reducer.accumulate(params[1])
    assert launched == [2, 1, 0]


def test_at_most_one_region_in_flight_and_finished_regions_free_their_staging():
    params, fset, regions, reducer, _launched = _setup()
    reducer.begin(launch=True)
    assert all(r.staging is None for r in regions)  # transient staging: allocated on the first gradient
    params[0].grad = torch.ones(SHAPES[0])
    reducer.accumulate(params[0])
    assert regions[0].handle is not None and reducer.inflight == [regions[0]]
    params[1].grad = torch.ones(SHAPES[1])
    reducer.accumulate(params[1])
    # Launching region 1 finished region 0: reduced, averaged into grad_partition, staging freed.
    assert reducer.inflight == [regions[1]] and regions[0].handle is None and regions[0].staging is None
    assert torch.equal(fset.grad_partition[:15], torch.ones(15))
    assert torch.equal(fset.grad_partition[15:], torch.zeros(26))  # region 1 is still in flight
    reducer.flush()
    assert reducer.inflight == [] and reducer.next == 0
    assert all(r.staging is None and r.handle is None and not r.ready for r in regions)


def test_a_second_backward_adds_to_the_gradient_partition():
    """Stages 2-3 under gradient accumulation: each backward reduces, the shards add up."""
    params, fset, _regions, reducer, launched = _setup()
    g1, g2 = _grads(1), _grads(2)
    _backward(reducer, params, g1)
    _backward(reducer, params, g2, order=[3, 1, 2, 0])
    assert launched == [0, 1, 2, 0, 1, 2]
    assert torch.allclose(fset.grad_partition, _flat(fset, g1) + _flat(fset, g2), rtol=0, atol=1e-6)
    fset.zero_grad()
    _backward(reducer, params, g1)
    assert torch.equal(fset.grad_partition, _flat(fset, g1))


def test_a_parameter_without_gradient_contributes_zeros():
    """The transient staging buffer is not zeroed when allocated: flush must zero the unused slot."""
    params, fset, regions, reducer, launched = _setup()
    grads = _grads(3)
    reducer.begin(launch=True)
    regions[2].buffer().fill_(float("nan"))  # what torch.empty may hand out
    for i in (0, 1, 3):  # c (slot 2) unused in this backward
        params[i].grad = grads[i].clone()
        reducer.accumulate(params[i])
    assert launched == [0, 1]
    reducer.flush()
    assert launched == [0, 1, 2]  # the incomplete last region launched at flush
    grads[2] = torch.zeros(SHAPES[2])
    assert torch.equal(fset.grad_partition, _flat(fset, grads))


def test_no_sync_accumulates_in_place_and_launches_at_the_boundary():
    """Stage 0/1 (in-place regions in the persistent full gradient buffer): micro-batches outside the
    accumulation boundary only add; the boundary's backward reduces the sum of all of them."""
    params, fset, regions, reducer, launched = _setup(in_place=True)
    assert all(r.staging is not None and r.staging.data_ptr() == fset.grad_full[r.start:].data_ptr()
               for r in regions)
    micro = [_grads(s) for s in (4, 5, 6)]
    _backward(reducer, params, micro[0], launch=False, flush=False)
    _backward(reducer, params, micro[1], order=[2, 3, 0, 1], launch=False, flush=False)
    assert launched == [] and reducer.inflight == []
    _backward(reducer, params, micro[2])
    assert launched == [0, 1, 2]
    expected = sum(_flat(fset, g) for g in micro)
    assert torch.allclose(fset.grad_full, expected, rtol=0, atol=1e-5)
    assert fset.grad_partition is None


def test_communication_dtype_rounds_what_travels():
    """communication_data_type bf16 with fp32 accumulation: a bf16 copy is reduced and cast back."""
    precision = PrecisionPolicy(comm_dtype=torch.bfloat16)
    params, fset, regions, reducer, _launched = _setup(precision)
    grads = [g * 1.001 for g in _grads(7)]  # values bf16 cannot hold exactly
    reducer.begin(launch=True)
    for p, g in zip(params[:2], grads[:2]):
        p.grad = g.clone()
        reducer.accumulate(p)
    assert regions[1].staging is None  # the cast copy is all that is kept while it travels
    assert regions[1].out.dtype == torch.bfloat16
    for p, g in zip(params[2:], grads[2:]):
        p.grad = g.clone()
        reducer.accumulate(p)
    reducer.flush()
    exact = _flat(fset, grads)
    assert fset.grad_partition.dtype == torch.float32
    assert torch.equal(fset.grad_partition, exact.bfloat16().float())
    assert not torch.equal(fset.grad_partition, exact)

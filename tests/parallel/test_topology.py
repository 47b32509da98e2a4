"""ProcessTopology's rank arithmetic against DeepSpeed's documented examples
(deepspeed/runtime/pipe/topology.py docstrings) and its errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsrun.runtime.parallel.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                             ProcessTopology, default_pipe_data_topology, prime_factors)


def test_pipe_model_data_2x2x2_rank_table():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    table = [tuple(topo.get_coord(rank)) for rank in range(topo.world_size())]
    assert table == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    for rank, (pipe, data, model) in enumerate(table):
        assert topo.get_rank(pipe=pipe, data=data, model=model) == rank
        assert topo.get_rank(model=model, pipe=pipe, data=data) == rank  # keyword order does not matter
    coord = topo.get_coord(5)
    assert (coord.pipe, coord.data, coord.model) == (1, 0, 1) and coord._fields == ("pipe", "data", "model")
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("sequence") == []  # an axis it lacks: no groups
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert [topo.get_coord(r) for r in topo.filter_match(pipe=0, data=1)] == [
        topo.ProcessCoord(pipe=0, data=1, model=0), topo.ProcessCoord(pipe=0, data=1, model=1)]
    assert topo.filter_match(model=1) == [1, 3, 5, 7] and topo.filter_match(model=2) == []
    assert topo.get_axis_list("data", 1) == [2, 3, 6, 7]
    assert topo.get_rank_repr(3) == "model_01"
    assert topo.get_rank_repr(6, omit_axes=[]) == "pipe_01-data_01-model_00"
    assert topo.get_rank_repr(6, omit_axes=["model"], inner_sep=":", outer_sep="/") == "pipe:01/data:01"


def test_two_axis_examples():
    topo = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert topo.get_rank(x=0, y=1) == 1 and topo.get_rank(x=1, y=0) == 3
    assert topo.get_dim("y") == 3 and topo.get_dim("z") == 0
    assert (topo.get_coord(rank=1).x, topo.get_coord(rank=1).y) == (0, 1)
    assert topo.get_axis_list(axis="x", idx=0) == [0, 1, 2]
    assert topo.get_axis_list(axis="y", idx=0) == [0, 3]
    assert topo.world_size() == 6
    assert str(topo).startswith("{ProcessCoord(x=0, y=0): 0, ProcessCoord(x=0, y=1): 1,")
    assert ProcessTopology(axes=["a", "b"], dims=[2, 2]).get_rank_repr(rank=3, omit_axes=[]) == "a_01-b_01"


def test_pipe_data_topology_puts_data_inside():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=4)
    assert topo.get_axis_names() == ["pipe", "data"] and topo.dims == [2, 4]
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # consecutive: one node
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_default_topology_alternates_prime_factors():
    assert prime_factors(12) == [2, 2, 3] and prime_factors(1) == [] and prime_factors(7) == [7]
    assert default_pipe_data_topology(8).dims == [4, 2]   # 2*2 stages, 2 replicas
    assert default_pipe_data_topology(6).dims == [2, 3]
    assert default_pipe_data_topology(1).dims == [1, 1]


@pytest.mark.parametrize("axes, dims, match", [
    (["pipe", "data"], [2], "one dim per axis"),
    (["pipe", "pipe"], [2, 2], "repeat"),
    (["pipe", "not-a-name"], [2, 2], "identifier"),
    (["pipe", "data"], [2, 0], "integer >= 1"),
    (["pipe"], [2.0], "integer >= 1"),
])
def test_bad_topologies_are_refused(axes, dims, match):
    with pytest.raises(ValueError, match=match):
        ProcessTopology(axes, dims)


def test_bad_questions_say_what_is_wrong():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    with pytest.raises(ValueError, match="filter_match"):
        topo.get_rank(pipe=0, data=1)  # a slice, not a rank
    with pytest.raises(ValueError, match="outside axis 'data'"):
        topo.get_rank(pipe=0, data=2, model=0)
    with pytest.raises(ValueError, match="unknown axis"):
        topo.get_rank(pipe=0, data=0, model=0, sequence=0)
    with pytest.raises(ValueError, match="not found"):
        topo.get_coord(8)
    with pytest.raises(ValueError, match="unknown axis"):
        topo.filter_match(expert=0)
    with pytest.raises(ValueError, match="unknown axis"):
        topo.get_axis_list("expert", 0)
    with pytest.raises(ValueError, match=">= 1"):
        prime_factors(0)


def test_any_integer_type_is_a_coordinate():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert topo.get_rank(pipe=torch.tensor(1), data=np.int64(2)) == 5
    assert topo.get_coord(np.int64(4)) == (1, 1)
    with pytest.raises(ValueError, match="outside axis 'data'"):
        topo.get_rank(pipe=0, data=1.0)

"""The parallelism mesh on real gloo ranks: every group holds exactly the
ranks the topology table says (checked by an all-reduce over the group),
the DeepSpeed grid and `dsrun.utils.groups` answer from it, and the data
axis splits into blocks."""
from __future__ import annotations

import pytest
import torch

from dsrun.runtime.parallel import mesh as mesh_mod
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.parallel.topology import PipeDataParallelTopology, ProcessTopology
from tests.dist_helpers import run_ranks


def _members(group, world_size: int) -> list[int]:
    """The global ranks of `group`, learnt by communicating over it: each
    member adds a one-hot vector of its rank."""
    import torch.distributed as dist
    one_hot = torch.zeros(world_size)
    one_hot[dist.get_rank()] = 1
    dist.all_reduce(one_hot, group=group)
    return [r for r in range(world_size) if one_hot[r] == 1]


def _expected(coords: dict[int, dict[str, int]], me: int, varying: tuple[str, ...]) -> list[int]:
    """The ranks whose coordinates equal mine on every axis not in `varying`."""
    return [r for r, c in coords.items()
            if all(c[a] == coords[me][a] for a in c if a not in varying)]


def _check_mesh(mesh: ParallelMesh, coords: dict[int, dict[str, int]]) -> dict:
    """Every group of `mesh` against the coordinate table `coords` (global
    rank -> {axis: coordinate}, written out by the test)."""
    import torch.distributed as dist
    me, world = dist.get_rank(), dist.get_world_size()
    varying = {"pipe": ("pipe",), "data": ("data",), "sequence": ("sequence",), "model": ("model",),
               "sequence_data": ("data", "sequence"), "pipe_model": ("pipe", "model")}
    for name, axes in varying.items():
        expected = _expected(coords, me, axes)
        assert _members(mesh.group(name), world) == expected, name
        assert list(mesh.ranks(name)) == expected and mesh.size(name) == len(expected), name
        assert mesh.rank(name) == expected.index(me), name
    for axis, value in coords[me].items():
        assert mesh.rank(axis) == value, axis
    return {"coord": tuple(mesh.coord(me)), "first_stage_peer": mesh.stage_to_global(0),
            "last_stage_other_data": mesh.stage_to_global(mesh.size("pipe") - 1, data=1 - mesh.rank("data"))}


def _pipe2_data2() -> dict:
    import torch.distributed as dist

    from dsrun.runtime.distributed.dist import init_distributed
    from dsrun.runtime.parallel.grid import PipelineParallelGrid
    from dsrun.utils import groups
    init_distributed()
    # before set_current: the default mesh is pure data parallelism over the world
    assert groups._get_data_parallel_world_size() == 4 and groups._get_data_parallel_group() is dist.group.WORLD
    assert groups._get_model_parallel_world_size() == 1
    assert _members(groups._get_model_parallel_group(), 4) == [dist.get_rank()]  # a one-rank group
    grid = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=2, num_dp=2))
    coords = {r: {"pipe": r // 2, "data": r % 2} for r in range(4)}
    out = _check_mesh(grid.mesh, coords)
    me = dist.get_rank()
    assert (grid.stage_id, grid.data_parallel_id) == (me // 2, me % 2)
    assert (grid.is_first_stage, grid.is_last_stage) == (me < 2, me >= 2)
    assert (grid.pipe_parallel_size, grid.data_parallel_size, grid.model_parallel_size) == (2, 2, 1)
    assert _members(grid.get_data_parallel_group(), 4) == [me - me % 2, me - me % 2 + 1]
    assert _members(grid.get_pipe_parallel_group(), 4) == [me % 2, me % 2 + 2]
    assert grid.get_data_parallel_group_ranks() == [me - me % 2, me - me % 2 + 1]
    mesh_mod.set_current(grid.mesh)
    assert (groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()) == (2, me % 2)
    assert _members(groups._get_data_parallel_group(), 4) == grid.get_data_parallel_group_ranks()
    assert groups._get_model_parallel_world_size() == 2  # the pipeline: one model copy
    assert groups.get_tensor_model_parallel_world_size() == 1
    assert groups._get_broadcast_src_rank() == me - me % 2
    mesh_mod.set_current(None)
    assert groups._get_data_parallel_world_size() == 4
    assert PipelineParallelGrid().topology().dims == [2, 2]  # DeepSpeed's default for 4 ranks
    with pytest.raises(ValueError, match="process_group=None"):
        PipelineParallelGrid(process_group=grid.get_data_parallel_group())
    with pytest.raises(ValueError, match="pass one of them"):
        PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=1, num_dp=4), mesh=grid.mesh)
    return out


def test_pipe2_data2_groups_grid_and_deepspeed_groups():
    results = run_ranks(_pipe2_data2, 4, timeout=60)
    assert [r["coord"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["first_stage_peer"] for r in results] == [0, 1, 0, 1]
    assert [r["last_stage_other_data"] for r in results] == [3, 2, 3, 2]


def _world8() -> dict:
    import torch.distributed as dist

    from dsrun.runtime.distributed.dist import init_distributed
    from dsrun.runtime.parallel.grid import PipelineParallelGrid
    from dsrun.utils import groups
    init_distributed()
    me = dist.get_rank()
    # pipe=2 x data=2 x model=2, DeepSpeed's PipeModelDataParallelTopology order
    mesh = ParallelMesh.build(8, pipe=2, model=2)
    coords = {r: {"pipe": r // 4, "data": r // 2 % 2, "model": r % 2} for r in range(8)}
    out = _check_mesh(mesh, coords)
    grid = PipelineParallelGrid(mesh=mesh)
    assert grid.get_slice_parallel_world_size() == grid.get_tensor_model_parallel_world_size() == 2
    assert grid.get_slice_parallel_rank() == me % 2
    assert _members(grid.get_slice_parallel_group(), 8) == [me - me % 2, me - me % 2 + 1]
    pipe_model = [r for r in range(8) if coords[r]["data"] == coords[me]["data"]]
    assert grid.get_model_parallel_world_size() == 4 and _members(grid.get_model_parallel_group(), 8) == pipe_model
    mesh_mod.set_current(mesh)
    assert groups.get_tensor_model_parallel_rank() == me % 2
    assert groups._get_model_parallel_rank() == pipe_model.index(me)
    assert _members(groups.get_model_parallel_group(), 8) == [me - me % 2, me - me % 2 + 1]
    # sequence parallelism: pipe=2 x data=2 x sequence=2, sequence innermost here
    seq = ParallelMesh.build(8, pipe=2, sequence=2)
    assert seq.topology.get_axis_names() == ["pipe", "data", "sequence", "model"]
    _check_mesh(seq, {r: {"pipe": r // 4, "data": r // 2 % 2, "sequence": r % 2, "model": 0} for r in range(8)})
    # data blocks: pipe=2 x data=4, blocks of 2 data ranks
    wide = ParallelMesh.build(8, pipe=2)
    blocks = wide.data_blocks(2)
    stage = me - me % 4
    assert _members(blocks.block.group, 8) == list(blocks.block.ranks) == [stage + me % 4 // 2 * 2 + i for i in (0, 1)]
    assert _members(blocks.replicate.group, 8) == list(blocks.replicate.ranks) == [stage + me % 2, stage + me % 2 + 2]
    assert (blocks.block.rank, blocks.replicate.rank) == (me % 2, me % 4 // 2)
    assert wide.data_blocks(2) is blocks  # cached: no second round of groups
    whole = wide.data_blocks(4)
    assert whole.block.ranks == wide.ranks("data") and whole.replicate.size == 1 and whole.replicate.group is None
    return out


def test_world8_pipe_data_model_sequence_and_blocks():
    results = run_ranks(_world8, 8, timeout=90)
    assert [r["coord"] for r in results] == [(p, d, m) for p in (0, 1) for d in (0, 1) for m in (0, 1)]
    assert [r["first_stage_peer"] for r in results] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [r["last_stage_other_data"] for r in results] == [6, 7, 4, 5, 6, 7, 4, 5]


def _local_groups() -> dict:
    """Ranks 2 and 3 alone make a group of theirs (local); rank 2 had made
    a one-rank group beforehand and rank 3 had not. Then every rank builds
    a pipe 2 x data 2 mesh: its groups must still connect."""
    import torch.distributed as dist

    import dsrun
    dsrun.init_distributed()
    flat = ParallelMesh.build(4)
    if dist.get_rank() == 2:
        flat.group("model")  # a one-rank group, made lazily on this rank only
    local = flat.make_group([(0, 1), (2, 3)], local=True) if dist.get_rank() >= 2 else None
    out = {"local": _members(local.group, 4) if local is not None else None,
           "local_rank": local.rank if local is not None else None}
    mesh = ParallelMesh.build(4, pipe=2)  # collective: every rank's group counter must agree
    out["pipe"] = _members(mesh.group("pipe"), 4)
    out["data"] = _members(mesh.group("data"), 4)
    return out


def test_local_groups_leave_the_other_ranks_groups_alone():
    """make_group(local=True) by some ranks only (an MoE layer on one
    pipeline stage): the members' group works and the job's later groups
    still match on every rank (with a collective new_group on ranks 2, 3
    only, ranks 0, 1 would name the pipe groups differently and hang)."""
    results = run_ranks(_local_groups, 4, timeout=90)
    assert [r["local"] for r in results] == [None, None, [2, 3], [2, 3]]
    assert [r["local_rank"] for r in results] == [None, None, 0, 1]
    assert [r["pipe"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["data"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_single_process_mesh_and_errors():
    import torch.distributed as dist
    mesh = mesh_mod.current()  # a mesh of this process alone (an earlier test may have made a one-rank group)
    assert (mesh.size("data"), mesh.size("pipe"), mesh.rank("model")) == (1, 1, 0)
    group = mesh.group("data")
    assert group is None if not dist.is_initialized() else dist.get_world_size(group) == 1
    assert mesh.stage_to_global(0) == 0 and mesh.ranks("sequence_data") == (0,)
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        ParallelMesh.build(4, pipe=3)
    with pytest.raises(ValueError, match="degrees must be integers >= 1"):
        ParallelMesh.build(4, model=0)
    with pytest.raises(ValueError, match="has 4 ranks but the job has 1"):
        ParallelMesh(PipeDataParallelTopology(num_pp=2, num_dp=2))
    with pytest.raises(ValueError, match="no group 'expert'"):
        mesh.rank("expert")
    with pytest.raises(ValueError, match="do not divide"):
        mesh.data_blocks(2)
    with pytest.raises(ValueError, match="only stage is 0"):
        ParallelMesh(ProcessTopology(["data"], [1])).stage_to_global(1)
    with pytest.raises(ValueError, match="outside axis 'data'"):
        mesh.stage_to_global(0, data=1)


def test_axis_named_like_a_combined_group_is_refused():
    with pytest.raises(ValueError, match="combined group"):
        ParallelMesh(ProcessTopology(["pipe_model"], [1]))


def _reinit() -> tuple:
    import torch.distributed as dist

    def init():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    init()
    first = mesh_mod.current()
    mine = ParallelMesh.build(1)
    mesh_mod.set_current(mine)
    assert mesh_mod.current() is mine
    dist.destroy_process_group()
    init()
    fresh = mesh_mod.current()  # the old meshes belong to a group that is gone
    with pytest.raises(ValueError, match="no longer exists"):
        mesh_mod.set_current(mine)
    return fresh is not first and fresh is not mine and fresh.belongs_to_current_world()


def test_current_mesh_follows_the_default_group():
    assert run_ranks(_reinit, 1, timeout=60) == [True]

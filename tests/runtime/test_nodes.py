"""Which node each rank is on (dsrun/runtime/distributed/nodes.py) and the node groups (zero/groups.py)."""
from __future__ import annotations

import pytest

from dsrun.runtime.distributed.nodes import NodeMap, map_from_reports
from tests.dist_helpers import as_nodes, run_ranks


def test_reports_of_consecutive_nodes_make_the_map():
    # 2 nodes of 2 ranks, then uneven nodes (3 + 1 slots in a hostfile)
    assert map_from_reports([(0, 2), (0, 2), (2, 2), (2, 2)]) == NodeMap(((0, 1), (2, 3)))
    uneven = map_from_reports([(0, 3), (0, 3), (0, 3), (3, 1)])
    assert uneven == NodeMap(((0, 1, 2), (3,)))
    assert uneven.ranks_per_node is None and uneven.same_local_rank() == ((0, 3), (1,), (2,))
    assert NodeMap.uniform(4, 2).same_local_rank() == ((0, 2), (1, 3))


@pytest.mark.parametrize("reports", [
    [(0, 2), (1, 2), (1, 2), (2, 2)],  # mpirun round-robin: local ranks 0,0,1,1 on ranks 0..3
    [(0, 2), (0, 2), (2, 3), (2, 3)],  # a node says 3 ranks but has 2
    [(0, 1), (0, 1)],                  # rank 1 claims local rank 1 of a 1-rank node
])
def test_reports_that_do_not_describe_nodes_give_no_map(reports):
    assert map_from_reports(reports) is None


def _groups_on_two_nodes():
    as_nodes(2)
    import torch
    import torch.distributed as dist

    import dsrun
    from dsrun.runtime.distributed import nodes
    from dsrun.runtime.parallel.mesh import current
    from dsrun.runtime.zero.groups import node_groups
    topo = dsrun.init_distributed()
    groups = node_groups(current())
    assert node_groups(current()) == groups  # cached, the same groups
    out = {"map": topo.nodes.nodes,
           "intra": dist.get_process_group_ranks(groups.intra.group),
           "inter": dist.get_process_group_ranks(groups.inter.group),
           "ranks": (groups.intra.rank, groups.inter.rank),
           "spans": (nodes.spans_nodes(None), nodes.spans_nodes(groups.intra.group),
                     nodes.spans_nodes(groups.inter.group))}
    dsrun.comm.comms_logger.reset()
    t = torch.tensor([float(topo.rank)])
    dsrun.comm.all_reduce(t, group=groups.intra.group)  # 4 bytes x 2(2-1)/2 = 4 bus bytes, intra-node
    out["intra_sum"] = float(t)
    dsrun.comm.all_gather_into_tensor(torch.empty(400), torch.ones(100))  # 1600 x 3/4 = 1200, spans nodes
    dsrun.comm.all_gather_into_tensor(torch.empty(200), torch.ones(100), group=groups.inter.group)  # 800 x 1/2
    stats = dsrun.comm.comms_logger.snapshot()
    out["bus"] = {op: (s.bus_bytes, s.inter_node_bus_bytes) for op, s in stats.items()}
    out["inter_total"] = dsrun.comm.comms_logger.inter_node_bus_bytes()
    return out


def test_four_ranks_as_two_nodes_give_intra_and_inter_node_groups():
    res = run_ranks(_groups_on_two_nodes, 4, timeout=120)
    for rank, r in enumerate(res):
        assert r["map"] == ((0, 1), (2, 3))
        assert r["intra"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["inter"] == [rank % 2, rank % 2 + 2]
        assert r["ranks"] == (rank % 2, rank // 2)
        assert r["spans"] == (True, False, True)
        assert r["intra_sum"] == (1.0 if rank < 2 else 5.0)
        # comms logger: a group inside one node is intra-node, a group spanning nodes inter-node, whole
        assert r["bus"] == {"all_reduce": (4, 0), "all_gather_into_tensor": (1200 + 400, 1200 + 400)}
        assert r["inter_total"] == 1600

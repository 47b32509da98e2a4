"""Two nodes over loopback SSH whose traffic really crosses a link between them.

node-b runs in a network namespace joined to node-a by a veth pair
(tests/multinode/netns_link.py, [Note: why node-b lives in a network
namespace]): bytes between the nodes cross the pair, where they are
counted and can be rate-limited, and bytes inside a node do not. This is
the set-up of bench/compression/two_node_step.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multinode.netns_link import node_link, python_wrapper
from tests.multinode.sshd import loopback_sshd

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

MIB, ITERS = 2.0, 3


def probe(cluster, link, wrapper: Path, hosts: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "dsrun.launcher.cli", "--hostfile", str(hosts), "--ssh_config", str(cluster.ssh_config),
         "--remote_python", str(wrapper), "--master_addr", link.addr_a,
         "tests/multinode/scripts/link_probe.py", "--mib", str(MIB), "--iters", str(ITERS), "--iface", link.iface_a],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = re.search(r"^\[rank 0\] PROBE (.*)$", out.stdout, re.M)
    assert line, out.stdout[-3000:]
    return json.loads(line.group(1))


def test_bytes_between_nodes_cross_the_link_and_bytes_inside_a_node_do_not(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    (tmp_path / "sshd").mkdir()
    message = MIB * 2**20
    with node_link() as link, loopback_sshd(tmp_path / "sshd", extra_addresses=(link.addr_a,)) as cluster:
        wrapper = python_wrapper(tmp_path / "python", sys.executable, link)
        free = probe(cluster, link, wrapper, hosts)
        # Every byte of a world all-reduce between the nodes is on the wire: each node must receive the
        # other's partial sums of all elements, so at least one message each way per all-reduce (gloo's
        # ring sends 1.5 each way: 2(p-1)/p over the two crossing edges of a 4-rank ring).
        assert free["world"] >= 2 * message * ITERS, free
        assert free["world"] <= 4 * message * ITERS, free  # and not more than the ring plus headers
        # The nodes' own all-reduces stay inside them (only the barriers around the phase cross).
        assert free["node"] < 0.02 * message * ITERS, free
        # dsrun's shared-memory transport never carries a collective between the nodes, and carries
        # the all-reduces of a group inside one node.
        assert free["world_transports"] == {"torch": ITERS}, free
        assert free["node_transports"] == {"shm": ITERS}, free
        link.set_rate("16mbit")  # 2 MB/s each way
        slow = probe(cluster, link, wrapper, hosts)
    # At 2 MB/s the 1.5 messages each way per all-reduce take at least 1.5 * 2 MiB / 2 MB/s = 1.57 s.
    assert slow["world_seconds"] >= 0.8 * 1.5 * message * ITERS / 2e6, (free, slow)
    assert slow["world_seconds"] > 3 * free["world_seconds"], (free, slow)

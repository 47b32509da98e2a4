"""`checkpoint.use_node_local_storage` (see [Note: node-local checkpoints] in
dsrun/runtime/checkpoint/node_local.py): 4 gloo ranks made 2 nodes of 2.

Node-local storage is simulated with a real path, not a hook: every rank
saves to and loads from the same path string, "/proc/self/cwd/ckpt", and
each node's ranks run in their own working directory (root/node0,
root/node1). /proc/self/cwd is the kernel's link to the calling process's
working directory, so the one path string names a different directory on
each node, as /local_nvme/ckpt does on each host of a cluster; no rank can
see the other node's files through it.
"""
import json
import os
import shutil

import pytest
import torch

from tests.checkpoint.test_checkpoint import _full_state, _run
from tests.dist_helpers import as_nodes, run_ranks
from tests.zero.models import TinyGPT, base_config, batches, param_groups

LOCAL = "/proc/self/cwd/ckpt"  # one path string, each node's own directory (see the module docstring)
TAG = "global_step2"


def _engine(seed=0):
    import dsrun

    torch.manual_seed(seed)
    model = TinyGPT()
    cfg = base_config(2, reduce_bucket_size=300, allgather_bucket_size=700)
    cfg["checkpoint"] = {"use_node_local_storage": True}
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=1e-2),
                                  config=cfg)
    return engine


def _record_reads():
    """The files this rank's checkpoint reader reads from (appended to the returned list)."""
    from dsrun.runtime.checkpoint import reader

    seen = []
    original = reader.SliceReader._read_file

    def read_file(self, file, wanted):
        seen.append(file)
        return original(self, file, wanted)
    reader.SliceReader._read_file = read_file
    return seen


def _same_layout(root):
    """Save on 2 nodes, resume on the same layout; then a save that fails on
    node 1 while writing its index."""
    from dsrun.runtime.checkpoint import CheckpointError, checkpointer

    rank = int(os.environ["RANK"])
    as_nodes(2)
    os.chdir(os.path.join(root, f"node{rank // 2}"))
    data = batches(rank, 4, 2, 1)
    out = {}
    engine = _engine()
    _run(engine, data[:2])
    engine.save_checkpoint(LOCAL, client_state={"epoch": 3})
    out["saved"] = _full_state(engine)
    out["continued"] = _run(engine, data[2:])
    reads = _record_reads()
    other = _engine(seed=5)
    path, client = other.load_checkpoint(LOCAL)
    out["load"] = (path, client, sorted(set(reads)))
    out["loaded"] = _full_state(other)
    out["resumed"] = _run(other, data[2:])

    def fail_on_node1(point):
        if point == "before_index" and rank == 2:
            raise OSError("disk full (injected)")
    checkpointer.fault_hook = fail_on_node1
    try:
        engine.save_checkpoint(LOCAL, tag="t_failed")
        out["failed_save"] = "no error"
    except (CheckpointError, OSError) as e:  # rank 2 raises its own error, the others name rank 2
        out["failed_save"] = str(e)
    checkpointer.fault_hook = None
    path, _ = other.load_checkpoint(LOCAL)  # the last tag on every node, not node 0's `latest`
    out["after_failure"] = path
    return out


def _other_layout(root):
    """2 ranks on one node (node 0's directory): the load names what to
    copy and reads nothing; after the copy it loads."""
    from dsrun.runtime import comm
    from dsrun.runtime.checkpoint import CheckpointError

    rank = int(os.environ["RANK"])
    as_nodes(2)
    os.chdir(os.path.join(root, "node0"))
    out = {}
    engine = _engine(seed=5)
    reads = _record_reads()
    try:
        engine.load_checkpoint(LOCAL, tag=TAG)
        out["error"] = "no error"
    except CheckpointError as e:
        out["error"] = str(e)
    out["read_before_error"] = list(reads)
    if rank == 0:  # the copy the error asks for
        for name in ("rank00002-of-00004.safetensors", "rank00003-of-00004.safetensors"):
            shutil.copy(os.path.join(root, "node1", "ckpt", TAG, name), os.path.join("ckpt", TAG, name))
    comm.barrier()
    path, client = engine.load_checkpoint(LOCAL, tag=TAG)
    out["loaded"] = (path, client, _full_state(engine))
    return out


@pytest.fixture(scope="module")
def node_local(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nodelocal"))
    for k in range(2):
        os.makedirs(os.path.join(root, f"node{k}"))
    return root, run_ranks(_same_layout, 4, root, timeout=240)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_each_node_holds_its_ranks_files_and_a_copy_of_the_index(node_local):
    root, _ = node_local
    dirs = [os.path.join(root, f"node{k}", "ckpt") for k in range(2)]
    for k, d in enumerate(dirs):
        shards = sorted(f for f in os.listdir(os.path.join(d, TAG)) if f.endswith(".safetensors"))
        assert shards == [f"rank{r:05d}-of-00004.safetensors" for r in (2 * k, 2 * k + 1)]
    indexes = [_read(os.path.join(d, TAG, "index.json")) for d in dirs]
    assert indexes[0] == indexes[1]  # rank 0's index, the same bytes on every node
    index = json.loads(indexes[0])
    assert index["written_on"] == {f"rank{r:05d}-of-00004.safetensors": r // 2 for r in range(4)}
    assert [n["ranks"] for n in index["nodes"]] == [[0, 1], [2, 3]]
    assert sorted(index["files"]) == sorted(index["written_on"])


def test_same_layout_round_trip_is_bitwise_and_reads_only_local_files(node_local):
    _, outs = node_local
    for rank, out in enumerate(outs):
        path, client, read = out["load"]
        assert path == os.path.join("/proc/self/cwd/ckpt", TAG) and client == {"epoch": 3}
        assert read == [f"rank{rank:05d}-of-00004.safetensors"]  # its own file, on its own node
        for saved, loaded in zip(out["saved"], out["loaded"]):
            assert _equal(saved, loaded)
        assert out["resumed"] == out["continued"]


def test_failed_index_write_on_one_node_commits_nothing(node_local):
    root, outs = node_local
    for out in outs:
        assert "rank(s) [2]" in out["failed_save"] or "disk full" in out["failed_save"], out["failed_save"]
    # Node 0 may hold the failed tag's index and `latest` (written beside node 1's failure): the load
    # still takes the newest tag complete on every node.
    assert not os.path.exists(os.path.join(root, "node1", "ckpt", "t_failed", "index.json"))
    assert _read(os.path.join(root, "node1", "ckpt", "latest")) == TAG.encode()
    assert [out["after_failure"] for out in outs] == [os.path.join(LOCAL, TAG)] * 4


def test_other_layout_names_the_files_to_copy_then_loads(node_local):
    root, outs = node_local
    other = run_ranks(_other_layout, 2, root, timeout=240)
    for out in other:
        error = out["error"]
        assert ("rank00002-of-00004.safetensors, rank00003-of-00004.safetensors from node 1 of the save "
                "(host ") in error, error
        assert "ranks 2-3) to node 0 (host " in error and "Nothing was read" in error
        assert "rank00000" not in error and "rank00001" not in error  # node 0 holds those
        assert out["read_before_error"] == []
        path, client, state = out["loaded"]
        assert path == os.path.join(LOCAL, TAG) and client == {"epoch": 3}
        for saved, loaded in zip(outs[0]["saved"], state):
            assert _equal(saved, loaded)

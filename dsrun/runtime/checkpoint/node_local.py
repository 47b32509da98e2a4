"""Checkpoints on node-local storage (`"checkpoint": {"use_node_local_storage": true}`).

[Note: node-local checkpoints]
DeepSpeed's setting: save_dir names a directory on each node's own disk
(the same path string on every node, a different file system behind it);
each node's local rank 0 creates it and writes the files only one rank
would otherwise write (there: the model states file and `latest`), and a
load reads the node's own copy. In dsrun's format this means:

- Save: each rank writes its shard into save_dir/<tag> as its own node sees
  it. Rank 0 cannot read the other nodes' shard headers, so in the
  "written" agreement each rank also sends its description (the header's
  JSON) and its host name; rank 0 builds the index from those, recording
  which node wrote each file (`Index.nodes`, `Index.written_on`; node ids
  from dsrun/runtime/distributed/nodes.py), and publishes the index's bytes
  through the store ("index" agreement). Every node's local rank 0 then
  writes those same bytes as its node's index.json, then `latest`, and
  prunes its node's old tags (checkpoint.keep_last); overwriting a tag, each
  node's local rank 0 first removes its node's index and old shards.
- Atomicity across nodes: a crash between two nodes' index writes leaves
  the tag complete on some nodes only, and `latest` may differ between
  nodes. A load without a tag therefore agrees on one (`agree_on_tag`): the
  tag every node's `latest` names, else the newest tag complete on every
  node, so a tag counts as committed only once its index is on every node.
- Load: every rank lists the files its reads need (`files_needed`: the
  stored slices its pieces overlap, its RNG states, rank 0's client_state
  tensors, a 1-bit optimizer's buffers) and checks they are in its node's
  directory (`check_local`, an agreement before any byte is read). On the
  layout that saved (same ranks on the same nodes) each rank needs its own
  file only (unless client_state held tensors or the optimizer is 1-bit:
  those live in rank 0's file), so every read is local. On another layout
  a rank's pieces span other ranks' files: when one is absent, every rank
  raises the same error, naming each missing file, the node (host, ranks)
  that wrote it and the node (host, ranks) that needs it, before anything
  was read. Once the files are copied there, the same load succeeds; so
  does a load of the directory gathered on one shared file system with
  use_node_local_storage off (the index is the ordinary one).
Each rank verifies the checksum of every file it reads (a file may be read
on several nodes, so the default split of verification over the ranks does
not apply).
"""
from __future__ import annotations

import json
import logging
import os
import socket

from dsrun.runtime.checkpoint.rendezvous import Rendezvous, raise_unless_all
from dsrun.runtime.checkpoint.store import (
    CheckpointError,
    Index,
    index_time,
    resolve_tag,
    tag_is_complete,
    tag_names,
)
from dsrun.runtime.distributed import nodes as nodes_mod
from dsrun.runtime.distributed.dist import Topology

log = logging.getLogger("dsrun.checkpoint")


def node_map(topology: Topology) -> nodes_mod.NodeMap:
    """The job's nodes (one node for a single process). Raises
    CheckpointError when the ranks' environment does not describe nodes."""
    if topology.world_size == 1:
        return nodes_mod.NodeMap(((0,),))
    try:
        return nodes_mod.require()
    except nodes_mod.NodeMapError as e:
        raise CheckpointError(f"checkpoint.use_node_local_storage needs to know each rank's node: {e}") from None


def is_node_leader(nodes: nodes_mod.NodeMap, rank: int) -> bool:
    """Whether `rank` is its node's local rank 0 (it writes the node's index and `latest`)."""
    return nodes.nodes[nodes.node_of(rank)][0] == rank


def host() -> str:
    return socket.gethostname()


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else ", ".join(map(str, ranks))


def agree_on_tag(rdv: Rendezvous, load_dir: str, tag: str | None) -> tuple[str | None, list[str]]:
    """The tag every rank loads, from each node's own load_dir (see [Note:
    node-local checkpoints]): the one every rank resolved (`resolve_tag`),
    else the newest tag complete on every node. Returns (tag or None when
    no tag is complete on every node, incomplete tags skipped on this node).
    Raises CheckpointError on every rank when a rank cannot list its directory."""
    error, mine = None, {"tag": None, "complete": []}
    skipped: list[str] = []
    try:
        resolved, skipped = resolve_tag(load_dir, tag)
        complete = [t for t in tag_names(load_dir) if tag_is_complete(os.path.join(load_dir, t))] \
            if os.path.isdir(load_dir) else []
        mine = {"tag": resolved, "complete": complete}
    except Exception as e:  # reported to every rank, then raised here
        error = e
    results = rdv.agree("node_tags", error is None, json.dumps(mine))
    raise_unless_all(results, error, f"finding the checkpoint tag in node-local {load_dir}")
    records = [json.loads(r) for _, r in results]
    if len({r["tag"] for r in records}) == 1:
        return records[0]["tag"], skipped
    common = set(records[0]["complete"]).intersection(*(r["complete"] for r in records[1:]))
    if not common:
        return None, skipped
    # The copies of one tag's index are the same bytes on every node, so every rank picks the same.
    chosen = max(sorted(common), key=lambda t: index_time(os.path.join(load_dir, t)))
    if rdv.rank == 0:
        found = ", ".join(f"rank {r}: {rec['tag']!r}" for r, rec in enumerate(records))
        log.warning("%s: the nodes' latest complete tags in %s differ (%s; a save failed between the nodes' "
                    "index writes?): loading %r, the newest tag complete on every node", rdv.what, load_dir,
                    found, chosen)
    return chosen, skipped


def files_needed(index: Index, requests: list[tuple[str, int, int]], full_keys: list[str]) -> list[str]:
    """The files holding elements [lo, hi) of each (name, lo, hi) in
    `requests` and every element of each name in `full_keys`, sorted."""
    files = set()
    for name, lo, hi in requests:
        files.update(s.file for s in index.tensors[name].slices if max(lo, s.lo) < min(hi, s.hi))
    for name in full_keys:
        files.update(s.file for s in index.tensors[name].slices)
    return sorted(files)


def client_keys(value) -> list[str]:
    """The tensor keys an index's client_state refers to."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            return [value["__tensor__"]]
        return [k for v in value.values() for k in client_keys(v)]
    if isinstance(value, list):
        return [k for v in value for k in client_keys(v)]
    return []


def check_local(rdv: Rendezvous, tag_dir: str, index: Index | None, needed: list[str],
                error: BaseException | None, nodes: nodes_mod.NodeMap) -> None:
    """Agree that every rank finds the files it needs in its node's
    `tag_dir` (and that it prepared its load without `error`), before any
    rank reads. Raises CheckpointError on every rank, naming each missing
    file, the node that saved it and the node that needs it (see [Note:
    node-local checkpoints])."""
    missing = [] if error is not None else [f for f in needed if not os.path.isfile(os.path.join(tag_dir, f))]
    report = json.dumps({"missing": missing, "host": host(), "failed": error is not None})
    reports = [json.loads(rep) for _, rep in rdv.agree("node_files", error is None and not missing, report)]
    if error is not None:
        raise error
    failed = [r for r, rep in enumerate(reports) if rep["failed"]]
    if failed:
        raise CheckpointError(f"loading checkpoint {tag_dir} failed on rank(s) {failed} (their own error is "
                              "raised there)")
    wanted: dict[str, dict[int, None]] = {}  # file -> current nodes needing it (ordered)
    for r, rep in enumerate(reports):
        for file in rep["missing"]:
            wanted.setdefault(file, {})[nodes.node_of(r)] = None
    if not wanted:
        return
    saved_nodes = index.nodes or []

    def source(file: str) -> str:
        k = index.written_on.get(file)
        if k is None or k >= len(saved_nodes):
            return "(no node recorded: the checkpoint was not saved on node-local storage)"
        return f"from node {k} of the save (host {saved_nodes[k].host}, ranks {_ranks(saved_nodes[k].ranks)})"

    def target(k: int) -> str:
        ranks = nodes.nodes[k]
        return f"node {k} (host {reports[ranks[0]]['host']}, ranks {_ranks(ranks)})"

    layout = "; ".join(f"node {k}: host {n.host}, ranks {_ranks(n.ranks)}" for k, n in enumerate(saved_nodes))
    groups: dict[tuple[str, str], list[str]] = {}  # (from, to) -> files
    for file, needing in sorted(wanted.items()):
        groups.setdefault((source(file), ", ".join(target(k) for k in needing)), []).append(file)
    copies = "; ".join(f"{', '.join(files)} {src} to {dst}" for (src, dst), files in groups.items())
    raise CheckpointError(
        f"checkpoint {tag_dir} was saved with checkpoint.use_node_local_storage by {index.world_size} ranks on "
        f"{len(saved_nodes)} node(s) ({layout}); this load ({nodes.world_size} ranks on {nodes.num_nodes} "
        f"node(s)) needs files that are not in {tag_dir} on the node reading them. Nothing was read. Copy "
        f"into {tag_dir} on each node named: {copies} (or gather every node's files in one shared directory "
        "and load it with use_node_local_storage off)")

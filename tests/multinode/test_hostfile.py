"""Hostfile grammar, include/exclude selection and placement (fast, no processes)."""
from pathlib import Path

import pytest
from rich.console import Console

from dsrun.launcher.hostfile import (Host, HostfileError, expand_host_pattern, parse_hostfile,
                                     parse_hostfile_text, select_slots)
from dsrun.launcher.placement import build_placement, compact_ranges, print_placement


def test_parse_comments_blank_lines_and_ranges():
    text = "# cluster\n\nworker-0 slots=4   # big one\n  node[01-03] slots=2\n"
    hosts = parse_hostfile_text(text)
    assert hosts == [Host("worker-0", 4), Host("node01", 2), Host("node02", 2), Host("node03", 2)]


def test_expand_patterns_keep_padding_and_product():
    assert expand_host_pattern("n[08-11,20]") == ["n08", "n09", "n10", "n11", "n20"]
    assert expand_host_pattern("r[1-2]c[1-2]") == ["r1c1", "r1c2", "r2c1", "r2c2"]
    assert expand_host_pattern("plain.host-1") == ["plain.host-1"]


@pytest.mark.parametrize("text, line, col, words", [
    ("a slots=2 gpus=4\n", 1, 11, "unexpected 'gpus=4'"),
    ("a slots=1\n  a slots=2\n", 2, 3, "listed twice (first on line 1)"),
    ("node[01-02] slots=1\nnode02 slots=1\n", 2, 1, "listed twice"),
    ("a\n", 1, 2, "missing slots"),
    ("a slot=4\n", 1, 3, "expected 'slots=N'"),
    ("# only comments\n\n", 1, 1, "lists no hosts"),
    ("", 1, 1, "lists no hosts"),
    ("node[03-01] slots=1\n", 1, 6, "descending"),
    ("node[01-x] slots=1\n", 1, 6, "bad host range"),
    ("node[01-02 slots=1\n", 1, 5, "unbalanced bracket"),
    ("a slots=-1\n", 1, 9, "slots must be >= 0"),
])
def test_hostfile_errors_have_position(text, line, col, words):
    with pytest.raises(HostfileError) as e:
        parse_hostfile_text(text, "hosts")
    assert (e.value.line, e.value.col) == (line, col), str(e.value)
    assert str(e.value).startswith(f"hosts:{line}:{col}: ")
    assert words in str(e.value)


def test_missing_explicit_hostfile_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_hostfile(tmp_path / "nope")


HOSTS = [Host("w0", 4), Host("w1", 4), Host("w2", 2)]


def test_bare_include_selects_all_slots():
    # DeepSpeed #6671: a bare host name selected nothing.
    assert select_slots(HOSTS, include="w1") == {"w1": [0, 1, 2, 3]}


def test_include_slots_ranges_and_hostfile_order():
    sel = select_slots(HOSTS, include="w2:1@w0:0,2-3")
    assert sel == {"w0": [0, 2, 3], "w2": [1]}


def test_exclude_slots_and_whole_hosts():
    assert select_slots(HOSTS, exclude="w0@w1:0-2") == {"w1": [3], "w2": [0, 1]}


@pytest.mark.parametrize("kw, words", [
    (dict(include="w0:4"), "slot 4 is beyond host 'w0'"),
    (dict(include="w9"), "host 'w9' is not in the hostfile"),
    (dict(include="w0@w0:1"), "named twice"),
    (dict(include="w0:2-1"), "descending"),
    (dict(include="w0:a"), "bad host range"),
    (dict(include="@w0"), "empty host name"),
])
def test_filter_errors(kw, words):
    with pytest.raises(HostfileError, match=words):
        select_slots(HOSTS, **kw)


@pytest.mark.parametrize("kw, words", [
    (dict(include="w0", exclude="w1"), "cannot be used together"),
    (dict(include="w0", num_nodes=1), "cannot be combined"),
    (dict(exclude="w0@w1@w2"), "no slot left"),
    (dict(num_nodes=4), "--num_nodes 4 is out of range"),
    (dict(num_procs=3), "host 'w2' has 2 slot"),
    (dict(num_procs=0), "must be >= 1"),
])
def test_selection_errors(kw, words):
    with pytest.raises(ValueError, match=words):
        select_slots(HOSTS, **kw)


def test_num_nodes_and_num_procs():
    assert select_slots(HOSTS, num_nodes=2, num_procs=2) == {"w0": [0, 1], "w1": [0, 1]}


def test_placement_is_node_major_and_prints():
    p = build_placement({"w0": [0, 2, 3], "w2": [1]})
    assert p.world_size == 4
    assert [n.global_ranks for n in p.nodes] == [[0, 1, 2], [3]]
    assert p.nodes[1].slots == (1,) and p.nodes[1].node_rank == 1
    console = Console(record=True, width=120)
    print_placement(p, console, master_addr="10.0.0.1")
    out = console.export_text()
    assert "world size 4" in out and "0-2" in out and "2-3" in out and "10.0.0.1" in out
    assert compact_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_shipped_example_parses():
    hosts = parse_hostfile(Path(__file__).resolve().parents[2] / "hostfile.example")
    assert [h.name for h in hosts] == ["worker-0", "worker-1", "node01", "node02", "node03", "node04"]

"""Checksums in the index: new saves record XXH3-128, format-1 checkpoints
(sha256, written by dsrun before format 2) still load and verify, and a
flipped byte is caught under either algorithm, naming the file.

tests/checkpoint/format1/ holds a format-1 checkpoint made by its
make_fixture.py (TinyGPT, stage 1, fp32, 2 ranks) and the full fp32
parameters and Adam states it holds (expected.safetensors).
"""
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dsrun.runtime.checkpoint import CheckpointError
from dsrun.runtime.checkpoint.cli import main
from dsrun.runtime.checkpoint.store import load_index, verify_file
from tests.checkpoint.test_checkpoint import _engine, _full_state, _run
from tests.dist_helpers import run_ranks
from tests.zero.models import batches

FORMAT1 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "format1")
TAG = "global_step2"
SHARD = "rank00001-of-00002.safetensors"


def _resave(src, dst):
    """One process at stage 3: load the format-1 checkpoint, keep its state,
    save it again (format 2), train a step."""
    engine = _engine(3, "fp32", {}, seed=5)
    path, client = engine.load_checkpoint(src)
    loaded = _full_state(engine)
    engine.save_checkpoint(dst, tag=TAG)
    _run(engine, batches(0, 1, 2, 1))
    return path, client, loaded


@pytest.fixture(scope="module")
def resaved(tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("format2"))
    return dst, run_ranks(_resave, 1, os.path.join(FORMAT1, "ckpt"), dst, timeout=120)[0]


def _flip_byte(tag_dir, file, at=-3):
    path = os.path.join(tag_dir, file)
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw[at] ^= 0x01
    with open(path, "wb") as f:
        f.write(raw)


def test_format1_loads_on_another_stage(resaved):
    _, (path, client, (params, states)) = resaved
    assert path.endswith(TAG) and client == {"epoch": 3}
    expected = load_file(os.path.join(FORMAT1, "expected.safetensors"))
    assert {f"param/{n}" for n in params} | {f"state/{k}" for k in states} == set(expected)
    for n, v in params.items():
        assert torch.equal(v, expected[f"param/{n}"]), n
    for k, v in states.items():
        assert torch.equal(v, expected[f"state/{k}"]), k


def test_new_index_names_xxh3(resaved):
    dst, _ = resaved
    index = load_index(os.path.join(dst, TAG))
    assert index.format_version == 2
    assert [(e.algorithm, len(e.checksum)) for e in index.files.values()] == [("xxh3_128", 32)]
    with open(os.path.join(dst, TAG, "index.json")) as f:
        raw = json.load(f)["files"]["rank00000-of-00001.safetensors"]
    assert sorted(raw) == ["algorithm", "bytes", "checksum"]


@pytest.mark.parametrize("fmt", ["format1", "format2"])
def test_verify_catches_a_flipped_byte(resaved, tmp_path, fmt):
    """`dsrun-ckpt verify` passes on the intact tag, names the file after one
    flipped bit in its tensor bytes (same size), and so does the loader's check."""
    src, file, algorithm = ((os.path.join(FORMAT1, "ckpt"), SHARD, "sha256") if fmt == "format1"
                            else (resaved[0], "rank00000-of-00001.safetensors", "xxh3_128"))
    runner = CliRunner()
    res = runner.invoke(main, ["verify", src])
    assert res.exit_code == 0 and f"OK ({algorithm})" in res.output, res.output
    copy = str(tmp_path / "copy")
    shutil.copytree(src, copy)
    tag_dir = os.path.join(copy, TAG)
    _flip_byte(tag_dir, file)
    res = runner.invoke(main, ["verify", copy])
    assert res.exit_code == 1, res.output
    assert f"{file} is corrupted: its {algorithm} checksum does not match" in res.output
    index = load_index(tag_dir)
    with pytest.raises(CheckpointError, match=f"{file} is corrupted"):
        verify_file(tag_dir, file, index.files[file])


def test_unknown_algorithm_is_refused(resaved, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(resaved[0], copy)
    path = os.path.join(copy, TAG, "index.json")
    with open(path) as f:
        index = json.load(f)
    for entry in index["files"].values():
        entry["algorithm"] = "blake9"
    with open(path, "w") as f:
        json.dump(index, f)
    res = CliRunner().invoke(main, ["verify", copy])
    assert res.exit_code == 1 and "unknown checksum algorithm 'blake9'" in res.output, res.output

"""A save that fills the disk: a real 60 MB tmpfs (mounted as root; the test
skips otherwise), 2 gloo ranks. The first checkpoint fits, the second does
not: one rank's shard lands, the other's runs out of space. Every rank
raises naming the disk, no file of the failed tag stays (see [Note: a
failed save leaves no files] in dsrun/runtime/checkpoint/save.py), and the
first checkpoint loads and resumes exactly."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from tests.dist_helpers import run_ranks

MOUNT_SIZE = "60m"
WIDTH = 1024  # a Linear(1024, 1024) with its Adam states: ~12.6 MB of checkpoint


def _engine(seed):
    import dsrun

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**6}
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine, seed):
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(seed + engine.global_rank))
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _leave_room_for_one_and_a_half_shards(root):
    """Fill the disk but for 1.5 x the larger shard of "first": of the next
    save's two shards, one fits and the other runs out of space."""
    first = os.path.join(root, "first")
    shard = max(os.path.getsize(os.path.join(first, f)) for f in os.listdir(first) if f.startswith("rank"))
    free = shutil.disk_usage(root).free
    with open(os.path.join(os.path.dirname(root), "filler"), "wb") as f:
        f.write(b"\0" * (free - int(1.5 * shard)))


def _fill_rank(root):
    from dsrun.runtime.checkpoint import CheckpointError

    engine = _engine(0)
    _step(engine, 1)
    engine.save_checkpoint(root, tag="first")
    after_first = [_step(engine, s) for s in (2, 3)]
    if engine.global_rank == 0:  # before the save's arrival check: no rank writes before this is done
        _leave_room_for_one_and_a_half_shards(root)
    try:
        engine.save_checkpoint(root, tag="second")
        error = None
    except (CheckpointError, OSError) as e:
        error = str(e)
    listing = {d: sorted(os.listdir(os.path.join(root, d))) if os.path.isdir(os.path.join(root, d)) else None
               for d in sorted(os.listdir(root))}
    resumed = _engine(7)
    path, _ = resumed.load_checkpoint(root)
    return {"error": error, "listing": listing, "loaded": os.path.basename(path),
            "resumed": [_step(resumed, s) for s in (2, 3)], "expected": after_first}


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 60 MB tmpfs at tmp_path/disk (unmounted afterwards)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={MOUNT_SIZE}", "tmpfs", str(disk)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_disk_full_mid_save_leaves_no_shard(small_tmpfs):
    root = small_tmpfs / "ckpt"
    root.mkdir()
    results = run_ranks(_fill_rank, 2, str(root), timeout=240)
    for rank, out in enumerate(results):
        assert out["error"] is not None, f"rank {rank}: the save that overflowed the disk did not raise"
        assert "No space left on device" in out["error"] or "failed on rank(s)" in out["error"], out["error"]
        assert str(root) in out["error"]  # names where it wrote
        assert out["listing"] == {"first": ["index.json", "rank00000-of-00002.safetensors",
                                            "rank00001-of-00002.safetensors"], "latest": None}
        assert out["loaded"] == "first"
        assert out["resumed"] == out["expected"]  # resumes exactly where the first checkpoint was taken
    assert any("No space left on device" in out["error"] for out in results)  # the disk is named
    assert (root / "latest").read_text() == "first"

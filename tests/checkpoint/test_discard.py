"""Old checkpoint files are moved aside at once and deleted in the background
(dsrun/runtime/checkpoint/discard.py)."""
import os
import threading

import pytest

from dsrun.runtime.checkpoint import discard
from dsrun.runtime.checkpoint.store import TRASH_PREFIX, resolve_tag, tag_names


def _tag(root, name, files=("rank00000-of-00001.safetensors", "index.json")):
    os.makedirs(os.path.join(root, name))
    for f in files:
        with open(os.path.join(root, name, f), "wb") as fh:
            fh.write(b"x" * 4096)
    return os.path.join(root, name)


@pytest.fixture
def held(monkeypatch):
    """Deletion threads wait until the test sets the event."""
    go, delete = threading.Event(), discard._delete
    monkeypatch.setattr(discard, "_delete", lambda dirs: (go.wait(), delete(dirs)))
    yield go
    go.set()
    discard.wait()


def test_paths_leave_at_once_and_are_deleted_later(tmp_path, held):
    root = str(tmp_path)
    old, keep = _tag(root, "old"), _tag(root, "keep")
    loose = os.path.join(keep, "rank00000-of-00002.safetensors")
    open(loose, "wb").close()
    discard.discard(root, [old, loose])
    assert not os.path.exists(old) and not os.path.exists(loose)
    trash = [d for d in os.listdir(root) if d.startswith(TRASH_PREFIX)]
    assert len(trash) == 1 and sorted(os.listdir(os.path.join(root, trash[0]))) == ["0-old", "1-rank00000-of-00002.safetensors"]
    assert tag_names(root) == ["keep"]
    held.set()
    discard.wait()
    assert sorted(os.listdir(root)) == ["keep"]
    assert sorted(os.listdir(keep)) == ["index.json", "rank00000-of-00001.safetensors"]


def test_hidden_directories_are_never_tags(tmp_path):
    root = str(tmp_path)
    _tag(root, TRASH_PREFIX + "abc")  # shards and an index, as a crash mid-way could leave them
    _tag(root, "t1", files=("rank00000-of-00001.safetensors",))  # incomplete
    assert tag_names(root) == ["t1"]
    assert resolve_tag(root, None) == (None, ["t1"])


def test_leftovers_of_a_crashed_run_go_with_the_next_discard(tmp_path):
    root = str(tmp_path)
    _tag(root, TRASH_PREFIX + "crashed")
    discard.discard(root, [_tag(root, "old")])
    discard.wait()
    assert os.listdir(root) == []


def test_a_path_that_cannot_move_raises_and_leaves_nothing_behind(tmp_path):
    root = str(tmp_path)
    old = _tag(root, "old")
    with pytest.raises(FileNotFoundError):
        discard.discard(root, [old, os.path.join(root, "missing")])
    discard.wait()
    assert os.listdir(root) == []  # "old" had moved: it is deleted with the hidden directory


def test_a_path_on_another_file_system_is_deleted_in_place(tmp_path, monkeypatch):
    import errno
    root = str(tmp_path)
    mounted, other = _tag(root, "mounted"), _tag(root, "other")
    rename = os.rename

    def cross_device(src, dst):
        if src == mounted:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        rename(src, dst)
    monkeypatch.setattr(discard.os, "rename", cross_device)
    discard.discard(root, [mounted, other])
    assert not os.path.exists(mounted) and not os.path.exists(other)
    discard.wait()
    assert os.listdir(root) == []

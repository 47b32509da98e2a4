"""The shard writer on its own: file contents, checksum, and the copy-on-write
snapshot (training changes tensors while an asynchronous write is half done)."""
import threading
import time

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from dsrun.runtime.checkpoint import checksum
from dsrun.runtime.checkpoint import writer as writer_mod
from dsrun.runtime.checkpoint.writer import ShardWriter, StagingBuffer
from dsrun.runtime.config import AioConfig

_NEW_DIGEST = checksum.new


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"module/w": torch.randn(1000, generator=g), "optim/w/exp_avg": torch.randn(1000, generator=g),
            "module/b": torch.randn(7, generator=g).to(torch.bfloat16), "rng/x": torch.arange(5, dtype=torch.uint8),
            "buffer/n": torch.tensor([3], dtype=torch.int64), "empty": torch.zeros(0)}


def _check_file(path, expected, written):
    with open(path, "rb") as f:
        raw = f.read()
    assert written.algorithm == "xxh3_128"
    assert len(raw) == written.bytes and xxhash.xxh3_128(raw).hexdigest() == written.checksum
    got = load_file(path)
    assert set(got) == set(expected)
    for key, t in expected.items():
        assert torch.equal(got[key], t), key


@pytest.mark.parametrize("engine", ["auto", "python"])
def test_blocking_write(tmp_path, monkeypatch, engine):
    monkeypatch.setattr(writer_mod, "CHUNK_BYTES", 1024)  # parts span several chunks
    real = writer_mod.AioHandle.from_config
    monkeypatch.setattr(writer_mod.AioHandle, "from_config", lambda aio: real(aio, engine=engine))
    tensors = _tensors()
    expected = {k: t.clone() for k, t in tensors.items()}
    w = ShardWriter(str(tmp_path / "s.safetensors"), tensors, {"k": "v"}, set(tensors), AioConfig())
    w.snapshot(StagingBuffer())
    _check_file(tmp_path / "s.safetensors", expected, w.write())
    assert not list(tmp_path.glob(".*tmp*"))


class _PausingDigest:
    """The checksum, whose update() stops at its `at`-th call until `go` is set."""

    def __init__(self, at, paused, go):
        self._h, self._n, self._at, self._paused, self._go = _NEW_DIGEST(), 0, at, paused, go

    def update(self, data):
        self._n += 1
        if self._n == self._at:
            self._paused.set()
            self._go.wait(10)
        self._h.update(data)

    def hexdigest(self):
        return self._h.hexdigest()


@pytest.mark.parametrize("pause_at", [1, 3, 6, 10**6])  # before any tensor, inside module/w, later, never
def test_copy_on_write_snapshot(tmp_path, monkeypatch, pause_at):
    """Tensors written in place are changed right after release(); the file
    holds the values of the save, wherever the writer was at the release."""
    monkeypatch.setattr(writer_mod, "CHUNK_BYTES", 1024)
    paused, go = threading.Event(), threading.Event()
    monkeypatch.setattr(writer_mod.checksum, "new", lambda: _PausingDigest(pause_at, paused, go))
    tensors = _tensors()
    expected = {k: t.clone() for k, t in tensors.items()}
    in_place = {"module/w", "optim/w/exp_avg"}
    staging = StagingBuffer()
    w = ShardWriter(str(tmp_path / "s.safetensors"), tensors, {}, in_place, AioConfig())
    w.snapshot(staging)
    for key in set(tensors) - in_place:  # staged at the call: the caller may change them at once
        tensors[key].fill_(1)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=w.write()))
    thread.start()
    # Until the writer pauses; with pause_at=10**6 it never does, and the release comes after the write.
    deadline = time.monotonic() + 10
    while not paused.wait(0.01) and thread.is_alive() and time.monotonic() < deadline:
        pass
    releaser = threading.Thread(target=w.release, args=(staging,))
    releaser.start()  # blocks until the chunk being hashed is written
    go.set()
    releaser.join(10)
    for key in in_place:  # the optimizer step
        tensors[key].mul_(-3).add_(1)
    thread.join(10)
    _check_file(tmp_path / "s.safetensors", expected, result["out"])


def test_slices_of_one_buffer_are_written_as_one_run(tmp_path, monkeypatch):
    """Slices adjacent in one buffer become one write (in memory order,
    whatever the key order); a slice staged at the call stays apart."""
    monkeypatch.setattr(writer_mod, "CHUNK_BYTES", 4096)
    flat, other = torch.randn(10000), torch.randn(10, dtype=torch.float64)
    tensors = {"d": flat[7000:], "c": other, "b": flat[3000:7000].view(40, 100), "a": flat[:3000],
               "e": flat[7000:7000]}
    expected = {k: t.clone() for k, t in tensors.items()}
    w = ShardWriter(str(tmp_path / "s.safetensors"), tensors, {}, {"a", "b", "c"}, AioConfig())
    runs = sorted(p.data.numel() for p in w.parts[1:])
    assert runs == sorted([7000 * 4, 3000 * 4, 10 * 8])  # a+b, d (not in place), c
    w.snapshot(StagingBuffer())
    _check_file(tmp_path / "s.safetensors", expected, w.write())


def test_large_runs_are_aligned_for_o_direct(tmp_path):
    """A run of at least ALIGNED_RUN_BYTES written from its own memory starts
    at a file offset congruent to its address modulo 4096 (a filler before
    it), the data section starts on a page, and the file is plain safetensors
    whose only extra keys are the fillers."""
    base = torch.randn(3 * writer_mod.ALIGNED_RUN_BYTES // 4 + 3)
    tensors = {"module/a": base[3:3 + writer_mod.ALIGNED_RUN_BYTES // 4],  # one run of two slices
               "optim/a/exp_avg": base[3 + writer_mod.ALIGNED_RUN_BYTES // 4:],
               "rng/x": torch.arange(5, dtype=torch.uint8),
               "module/b": torch.randn(writer_mod.ALIGNED_RUN_BYTES // 4 + 1)}
    expected = {k: t.clone() for k, t in tensors.items()}
    w = ShardWriter(str(tmp_path / "s.safetensors"), tensors, {"k": "v"}, set(tensors), AioConfig())
    assert w.parts[0].data.numel() % 4096 == 0 and w.parts[0].data.data_ptr() % 4096 == 0
    large = [p for p in w.parts[1:] if p.data.numel() >= writer_mod.ALIGNED_RUN_BYTES]
    assert len(large) == 2  # module/a + optim/a/exp_avg joined, module/b
    assert all((p.offset - p.data.data_ptr()) % 4096 == 0 for p in large)
    written = w.write()
    with open(tmp_path / "s.safetensors", "rb") as f:
        raw = f.read()
    assert len(raw) == written.bytes and xxhash.xxh3_128(raw).hexdigest() == written.checksum
    got = load_file(tmp_path / "s.safetensors")
    fillers = {k for k in got if k.startswith(writer_mod.FILLER_PREFIX)}
    assert fillers and all(not got[k].any() and got[k].numel() < 4096 for k in fillers)
    assert set(got) - fillers == set(expected)
    for key, t in expected.items():
        assert torch.equal(got[key], t), key

"""The slice reader on its own: reads land in place (any window size, dtype
casts, joined ranges), each verified file is hashed on the way, a corrupted
byte anywhere in a verified file fails the read naming the file."""
import json

import pytest
import torch

from dsrun.runtime.checkpoint import reader as reader_mod
from dsrun.runtime.checkpoint.reader import SliceReader
from dsrun.runtime.checkpoint.store import CheckpointError, Index, StoredSlice, TensorEntry
from dsrun.runtime.checkpoint.writer import ShardWriter, StagingBuffer
from dsrun.runtime.config import AioConfig

N = 40_000  # elements per tensor: large enough for aligned runs (fillers in the file)


def _checkpoint(tmp_path):
    """Two shards, each holding half of tensors w (fp32) and b (bf16)."""
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(2 * N, generator=g), "b": torch.randn(2 * N, generator=g).to(torch.bfloat16)}
    tensors = {name: TensorEntry(shape=[2 * N], dtype=str(t.dtype).removeprefix("torch."))
               for name, t in full.items()}
    files = {}
    for r in range(2):
        file = f"rank{r}.safetensors"
        part = {name: t[r * N:(r + 1) * N].clone() for name, t in full.items()}
        w = ShardWriter(str(tmp_path / file), part, {"k": "v"}, set(part), AioConfig())
        w.snapshot(StagingBuffer())
        files[file] = w.write()
        for name in full:
            tensors[name].slices.append(StoredSlice(file=file, key=name, lo=r * N, hi=(r + 1) * N))
    index = Index(tag="t", dsrun_version="0", torch_version="0", world_size=2, stage=1, precision="fp32",
                  config={}, tensors=tensors, files=files)
    return full, index


@pytest.mark.parametrize("window", [reader_mod.WINDOW_BYTES, 4096 * 3])
def test_read_many_fills_in_place(tmp_path, monkeypatch, window):
    monkeypatch.setattr(reader_mod, "WINDOW_BYTES", window)
    full, index = _checkpoint(tmp_path)
    reader = SliceReader(str(tmp_path), index)
    w = torch.zeros(2 * N)
    b64 = torch.zeros(N + 10, dtype=torch.float64)  # cast on the way, across both files
    inner, again = torch.zeros(10), torch.zeros(N + 1)  # ranges inside and across others
    reader.read_many([("w", 0, N, w[:N]), ("w", N, 2 * N, w[N:]), ("b", N - 5, 2 * N + 5 - 10, b64[:N]),
                      ("w", 7, 17, inner), ("w", N - 1, 2 * N, again)])
    assert torch.equal(w, full["w"])
    assert torch.equal(inner, full["w"][7:17]) and torch.equal(again, full["w"][N - 1:])
    assert torch.equal(b64[:N], full["b"][N - 5:2 * N - 5].double())
    assert torch.equal(reader.read_full("b"), full["b"])
    reader.verify_rest()  # both files were checked by the reads: nothing is left


def _flip(path, key):
    """Flip a byte inside tensor `key`'s data."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n + json.loads(raw[8:8 + n])[key]["data_offsets"][0] + 1] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_corrupted_byte_nobody_reads_still_fails_the_read(tmp_path):
    full, index = _checkpoint(tmp_path)
    _flip(tmp_path / "rank1.safetensors", "b")  # only w is read
    with pytest.raises(CheckpointError, match="rank1.safetensors is corrupted"):
        SliceReader(str(tmp_path), index).read_into("w", 0, 2 * N, torch.zeros(2 * N))
    # A reader that checks only rank0's file (another rank checks rank1's) reads w,
    # and verify_rest finds nothing of its own to check.
    reader = SliceReader(str(tmp_path), index, verify_files={"rank0.safetensors"})
    out = torch.zeros(2 * N)
    reader.read_into("w", 0, 2 * N, out)
    assert torch.equal(out, full["w"])
    reader.verify_rest()
    # The rank that checks rank1's file fails even when it reads nothing from it.
    with pytest.raises(CheckpointError, match="rank1.safetensors is corrupted"):
        SliceReader(str(tmp_path), index, verify_files={"rank1.safetensors"}).verify_rest()


def test_truncated_and_missing_files_are_named(tmp_path):
    _, index = _checkpoint(tmp_path)
    path = tmp_path / "rank0.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="rank0.safetensors is truncated"):
        SliceReader(str(tmp_path), index, verify=False).read_full("w")
    path.unlink()
    with pytest.raises(CheckpointError, match="rank0.safetensors is missing"):
        SliceReader(str(tmp_path), index).read_full("w")

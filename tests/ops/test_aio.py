"""Async file I/O (dsrun.ops.aio): both native engines and the fallback, sizes, errors."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dsrun.ops import aio, builder
from dsrun.ops.builder import get_op

ROOT = Path(__file__).resolve().parents[2]

# Sizes around the 4 KiB O_DIRECT unit and the 64 KiB blocks used below,
# including DeepSpeed's failing 4196 bytes and zero.
SIZES = [0, 1, 4096, 4196, 3 * 65536 + 7, 1 << 20]


@pytest.fixture(scope="module", autouse=True)
def native_aio():
    # The op needs gcc and the kernel's headers only: a fresh machine builds it.
    assert get_op("aio").load() is not None, f"aio did not build: {get_op('aio').reason}"


@pytest.fixture(params=["io_uring", "libaio", "python"])
def handle(request):
    with aio.AioHandle(block_size=65536, queue_depth=4, intra_op_parallelism=2, engine=request.param) as h:
        assert h.engine == request.param  # the native engine itself ran, not the fallback
        yield h


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 4096, 5])
def test_roundtrip_any_size_and_alignment(handle, tmp_path, n, offset):
    data = _random_bytes(n, n + offset)
    path = tmp_path / "x.bin"
    path.write_bytes(b"\xee" * (offset + n + 3))  # bytes after the range must survive the write
    unaligned = torch.empty(n + 1, dtype=torch.uint8)[1:].copy_(data)  # forces bounce buffers
    assert handle.pwrite(unaligned, path, offset) == n
    raw = path.read_bytes()
    assert raw[offset:offset + n] == data.numpy().tobytes()
    assert raw[:offset] == b"\xee" * offset and raw[offset + n:] == b"\xee" * 3
    out = aio.new_aligned_tensor(n)
    assert out.data_ptr() % 4096 == 0
    assert handle.pread(out, path, offset) == n and torch.equal(out, data)


def test_new_file_of_unaligned_size_has_exact_size(handle, tmp_path):
    # DeepSpeed's aio left a 0-byte file for a 4196-byte write.
    t = torch.arange(1049, dtype=torch.float32)  # 4196 bytes
    handle.pwrite(t, tmp_path / "t.bin")
    assert (tmp_path / "t.bin").stat().st_size == 4196
    back = torch.empty_like(t)
    handle.pread(back, tmp_path / "t.bin")
    assert torch.equal(back, t)


def test_async_many_requests_then_wait(handle, tmp_path):
    tensors = [torch.randn(10_000 + 999 * i) for i in range(5)]
    for i, t in enumerate(tensors):
        handle.async_pwrite(t, tmp_path / f"{i}.bin")
    assert handle.wait() == 5
    outs = [torch.empty_like(t) for t in tensors]
    for i, o in enumerate(outs):
        handle.async_pread(o, tmp_path / f"{i}.bin")
    assert handle.wait() == 5
    assert all(torch.equal(a, b) for a, b in zip(tensors, outs))
    # bf16 tensors (no numpy dtype) travel as bytes too
    b = torch.randn(777).to(torch.bfloat16)
    handle.pwrite(b, tmp_path / "b.bin")
    c = torch.empty_like(b)
    handle.pread(c, tmp_path / "b.bin")
    assert torch.equal(b, c)


@pytest.mark.parametrize("engine", aio.ENGINES)
@pytest.mark.parametrize(("single_submit", "overlap_events"), [(False, True), (True, True), (False, False),
                                                               (True, False)])
def test_submission_modes_wrap_the_rings_many_times(tmp_path, engine, single_submit, overlap_events):
    # 3 MiB + 5 bytes in 16 KiB blocks, 3 in flight (io_uring rounds its rings up to 4 entries):
    # about 190 requests per direction on each of 2 threads, so every ring index wraps dozens of times.
    data = _random_bytes(3 * (1 << 20) + 5, 11)
    with aio.AioHandle(block_size=16384, queue_depth=3, intra_op_parallelism=2, single_submit=single_submit,
                       overlap_events=overlap_events, engine=engine) as h:
        assert h.engine == engine
        h.pwrite(data, tmp_path / "x.bin")
        back = torch.empty_like(data)
        h.pread(back, tmp_path / "x.bin")
    assert torch.equal(back, data)


def test_errors_name_file_and_errno(handle, tmp_path):
    missing = tmp_path / "no_such_dir" / "x.bin"
    with pytest.raises(FileNotFoundError) as e:
        handle.async_pwrite(torch.zeros(10), missing)
    assert e.value.errno == errno.ENOENT and e.value.filename == str(missing)
    with pytest.raises(FileNotFoundError):
        handle.pread(torch.zeros(10), missing)
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="read past end of file") as e:
        handle.pread(torch.zeros(100, dtype=torch.uint8), short, offset=1)
    assert e.value.errno == errno.ENODATA and e.value.filename == str(short)
    assert handle.wait() == 0  # the failed requests left nothing pending


def test_full_tmpfs_raises_enospc(tmp_path):
    # A real file system running out of space part way through a request
    # (tmpfs has no O_DIRECT: this also covers the buffered path).
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"cannot mount a tmpfs (needs root): {proc.stderr}"
    try:
        for engine in ("io_uring", "libaio", "python"):
            with aio.AioHandle(block_size=65536, engine=engine) as h:
                with pytest.raises(OSError) as e:
                    h.pwrite(torch.zeros(1 << 20, dtype=torch.uint8), mnt / f"{engine}.bin")
                assert e.value.errno == errno.ENOSPC and e.value.filename == str(mnt / f"{engine}.bin")
                (mnt / f"{engine}.bin").unlink()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_wait_releases_the_gil(tmp_path):
    h = aio.AioHandle(block_size=1 << 20, queue_depth=2, engine="io_uring")
    big = torch.ones(32 << 20, dtype=torch.uint8)
    h.pwrite(big, tmp_path / "big.bin")
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
    t = threading.Thread(target=count)
    t.start()
    time.sleep(0.05)
    before = ticks
    for _ in range(3):
        h.pread(big, tmp_path / "big.bin")
    during = ticks - before
    stop.set()
    t.join()
    assert during > 1000  # the counting thread ran while the main thread waited in C


def test_from_config_and_bad_arguments():
    h = aio.AioHandle.from_config({"block_size": 8192, "queue_depth": 2, "thread_count": 3})
    assert (h.block_size, h.queue_depth, h.threads) == (8192, 2, 3)
    with pytest.raises(ValueError, match="multiple of 4096"):
        aio.AioHandle(block_size=1000)
    with pytest.raises(ValueError, match="up to 1073741824"):  # io_uring's request length is 32 bits
        aio.AioHandle(block_size=2 << 30)
    with pytest.raises(ValueError, match="engine must be"):
        aio.AioHandle(engine="posix")
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        h.pwrite(torch.zeros(10, 2).t(), "/tmp/never")


# Run in a fresh process whose compiler sees <liburing.h> and <libaio.h> as
# `#error` (CPATH directories come before the system's): a cold build of the
# op into an empty cache, then each native engine forced, on a file system
# that takes O_DIRECT.
FRESH_MACHINE_CHECK = """
import os, sys, torch
from dsrun.ops import aio
from dsrun.ops.builder import get_op
op = get_op("aio")
assert op.load() is not None, f"aio did not build: {op.reason}"
print("LIBRARY", op.path)
data_dir = sys.argv[1]
n, offset = (1 << 20) + 4096 + 5, 4096  # an aligned 1 MiB + 4 KiB, then a 5-byte tail
data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
src = aio.new_aligned_tensor(n).copy_(data)
for engine in aio.ENGINES:
    with aio.AioHandle(block_size=65536, queue_depth=4, intra_op_parallelism=2, engine=engine) as h:
        assert h.engine == engine, h.engine
        path = os.path.join(data_dir, engine + ".bin")
        assert h.pwrite(src, path, offset) == n
        back = aio.new_aligned_tensor(n)
        assert h.pread(back, path, offset) == n
        assert torch.equal(back, data), engine + ": read back differs"
        print("ENGINE", engine, "direct_bytes", h.direct_bytes)
"""


def _o_direct_dir(*candidates):
    for d in candidates:
        try:
            os.close(os.open(d, os.O_RDWR | os.O_TMPFILE | os.O_DIRECT, 0o600))  # an unnamed file
            return d
        except OSError:
            continue
    pytest.fail(f"none of {candidates} takes O_DIRECT: cannot check the engines' O_DIRECT path")


def test_builds_without_liburing_or_libaio_headers_and_io_uring_runs_o_direct(tmp_path):
    hidden = tmp_path / "hidden_headers"
    hidden.mkdir()
    for header in ("liburing.h", "libaio.h"):
        (hidden / header).write_text(f'#error "<{header}> is out of reach in this test"\n')
    env = dict(os.environ, CPATH=str(hidden), DSRUN_OPS_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # The hiding works: a source that includes liburing fails to compile.
    probe = subprocess.run([builder.compiler(), "-x", "c++", "-E", "-o", os.devnull, "-"], env=env, text=True,
                           input="#include <liburing.h>\n", capture_output=True)
    assert probe.returncode != 0 and "out of reach" in probe.stderr, probe.stderr
    data_dir = _o_direct_dir(str(tmp_path), "/var/tmp")
    proc = subprocess.run([sys.executable, "-c", FRESH_MACHINE_CHECK, data_dir], env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lib = Path(out.split("LIBRARY ", 1)[1].split()[0])
    assert lib.is_relative_to(tmp_path / "cache"), f"{lib} was not built by this test"  # no prebuilt, no old cache
    ninja = (lib.parent / "build.ninja").read_text()
    (ldflags,) = [ln for ln in ninja.splitlines() if ln.startswith("ldflags =")]
    assert "-luring" not in ldflags and "-laio" not in ldflags, ldflags
    dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    needed = [ln for ln in dynamic.splitlines() if "(NEEDED)" in ln]
    assert needed and not any("uring" in ln or "libaio" in ln for ln in needed), needed
    middle = (1 << 20) + 4096  # the 4 KiB-aligned part of the request, written and read with O_DIRECT
    for engine in aio.ENGINES:
        assert f"ENGINE {engine} direct_bytes {2 * middle}" in out, out

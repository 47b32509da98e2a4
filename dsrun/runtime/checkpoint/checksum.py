"""The checksum of a checkpoint file: which algorithm, and computing it.

[Note: checkpoint checksums]
The index records, per file, the algorithm and the hex digest of the whole
file. New checkpoints use XXH3-128 (Collet, xxHash, "XXH3" in its
specification doc/xxhash_spec.md; the `xxhash` package): a non-cryptographic
128-bit hash that runs at memory speed (23 GB/s on one core of the
development machine, against 1.8 GB/s for sha256, which made sha256 the bound
of a save: every byte of a save is hashed while the disk writes it). A
checksum here detects torn, truncated or bit-rotted files, not tampering: a
checkpoint is trusted code-free data (no pickle), not a signed artifact.
Checkpoints written by earlier dsrun versions (and DeepSpeed imports made by
them) record sha256, which stays readable.

Both `xxhash.xxh3_128` and `hashlib.sha256` release the GIL on large
buffers, so hashing overlaps the I/O thread's writes.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import xxhash

DEFAULT = "xxh3_128"
_ALGORITHMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_READ_BYTES = 8 << 20


def new(algorithm: str = DEFAULT) -> Any:
    """A fresh hash object (`update(bytes-like)`, `hexdigest()`). Raises
    ValueError for an algorithm this dsrun does not know."""
    try:
        return _ALGORITHMS[algorithm]()
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r} (this dsrun knows "
                         f"{', '.join(sorted(_ALGORITHMS))}); a newer dsrun wrote this checkpoint?") from None


def file_digest(path: str, algorithm: str) -> str:
    """Hex digest of the whole file at `path` (read in 8 MiB pieces into one
    reused buffer). Raises ValueError (unknown algorithm) or OSError."""
    digest = new(algorithm)
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()

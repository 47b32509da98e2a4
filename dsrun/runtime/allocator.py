"""Keep freed host memory from staying resident: the glibc allocator policy.

[Note: glibc and peak RSS]
ZeRO frees large host tensors all the time (a parameter's original storage
once it moved into a flat buffer, gradient staging buckets, gathered stage-3
units). glibc serves an allocation from the heap unless it is larger than
its mmap threshold, and that threshold is *dynamic*: each time an mmapped
chunk is freed the threshold rises to its size (up to 32 MiB). After the
first 16 MiB tensor is freed, every later 16 MiB tensor lives on the heap,
where a freed block stays resident until the heap's top is trimmed; the
holes add up and RSS climbs far above the bytes actually live (measured:
zero.Init construction left 309 MiB resident for a 192 MiB partition).

`use_returning_allocator()` fixes the threshold with mallopt(M_MMAP_THRESHOLD,
1 MiB) -- which also switches the dynamic adjustment off -- so every tensor
of 1 MiB or more is its own mapping and goes back to the kernel when freed,
and `trim()` (malloc_trim) returns what the heap holds free at points where
a lot was just released. The price is a page fault per fresh page of a new
large tensor, which the kernel zeroes; small tensors still use the heap.
It does nothing where glibc is absent, when the user chose a threshold
already (MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES), or with DSRUN_MALLOC=0.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
THRESHOLD_BYTES = 1 << 20

_libc = None
_configured = False


def _glibc():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            lib = None
        _libc = lib if lib is not None and hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
    return _libc or None


def _user_chose() -> bool:
    return ("MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")
            or os.environ.get("DSRUN_MALLOC", "1").strip() == "0")


def use_returning_allocator() -> bool:
    """Fix glibc's mmap threshold at 1 MiB (see [Note: glibc and peak RSS]).

    Idempotent. Returns True when the policy is in effect (set now or before).
    """
    global _configured
    if _configured:
        return True
    lib = _glibc()
    if lib is None or _user_chose():
        return False
    _configured = bool(lib.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
    return _configured


def trim() -> None:
    """Give the heap's free memory back to the kernel (glibc malloc_trim; no-op elsewhere)."""
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)

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

[Note: caching host allocator]
Returning every large block to the kernel has a price: the next tensor of
that size is a fresh mapping, and each of its 4 KiB pages costs a page fault
and the kernel's zeroing on first touch. A training step frees and
allocates the same large buffers again and again (a ZeRO-3 unit's gathered
weights twice a step, each gradient staging region, the gradients
themselves, activations), and on the 48M-parameter GPT at stages 2-3 that
was 570-700k page faults per step on 2 ranks against DDP's 260k, 10% more
CPU time per step (bench/step_time/README.md). Measured one 12.6 MB buffer,
loaded machine: fresh 7-28 ms, reused 0.3-0.9 ms.

So, with the threshold, torch's CPU allocator is replaced by a caching one
for tensors of 1 MiB or more (csrc/host_alloc, op "host_alloc"; smaller
tensors still go to the allocator that was there): a freed block is kept,
by its size rounded up to whole pages, and handed to the next request of
exactly that size. The rule that keeps it from costing memory: the bytes
cached plus the bytes live never exceed the peak of live bytes reached so
far. A block freed when that would be exceeded goes back to the kernel, and
a request the cache cannot serve first gives back cached blocks (largest
first) until the new block fits under that peak. So the cache never raises
the process's peak RSS; it only keeps what the step already needed at once
and will need again (what a step frees in backward, the next forward
allocates). Between steps RSS stays near the step's peak instead of
dropping; `trim()` empties the cache and restarts the peak (the runtime
calls it after `initialize`, whose transients must not set the peak for
training). DSRUN_HOST_CACHE_MB caps the cached bytes further; 0 turns the
cache off (the threshold alone stays). Blocks are mmapped, so page-aligned;
blocks of HUGE_BYTES or more are 2 MiB-aligned and advised to use
transparent huge pages (see [Note: huge pages] in csrc/host_alloc: 40x
fewer page faults per step, checkpoint saves 7-31% and loads 30-48% faster
on this machine's disk), and `adopt_parameters` moves the parameters that
stage 0 keeps in place onto them; DSRUN_HOST_HUGEPAGES=0 keeps 4 KiB pages.
Without the op (DSRUN_OPS_DISABLE=host_alloc, no compiler) the threshold
alone is in effect.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from dsrun.env import HOST_CACHE_MB, HOST_HUGEPAGES, MALLOC

M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
THRESHOLD_BYTES = 1 << 20
HUGE_BYTES = 2 << 20  # blocks from this size on are advised to use huge pages

_libc = None
_configured = False
_cache_installed = False
_huge_pages = False  # the installed cache maps large blocks on huge pages


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
            or not MALLOC.read())


def use_returning_allocator() -> bool:
    """Fix glibc's mmap threshold at 1 MiB and install the caching host
    allocator for tensors of that size or more (see [Note: glibc and peak
    RSS] and [Note: caching host allocator]).

    Idempotent. Returns True when the threshold policy is in effect (set now
    or before); the caching allocator is installed on top when its native op
    loads and DSRUN_HOST_CACHE_MB is not 0.
    Raises ValueError when DSRUN_HOST_CACHE_MB is not a whole number >= 0
    or DSRUN_HOST_HUGEPAGES is neither 0 nor 1.
    """
    global _configured
    if _configured:
        return True
    lib = _glibc()
    if lib is None or _user_chose():
        return False
    _configured = bool(lib.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
    if _configured:
        _install_cache()
    return _configured


def _cache_cap_bytes() -> int | None:
    """DSRUN_HOST_CACHE_MB in bytes; None when unset (the peak rule alone)."""
    mib = HOST_CACHE_MB.read()
    return None if mib is None else mib << 20


def _huge_bytes() -> int:
    """HUGE_BYTES, or 0 when DSRUN_HOST_HUGEPAGES is 0."""
    return HUGE_BYTES if HOST_HUGEPAGES.read() else 0


def _install_cache() -> None:
    cap, huge = _cache_cap_bytes(), _huge_bytes()
    if cap == 0:
        return
    from dsrun.ops.builder import get_op

    global _cache_installed, _huge_pages
    op = get_op("host_alloc").load()  # None: the reason was logged once; the threshold alone holds
    if op is None:
        return
    code = op.dsrun_host_alloc_install(ctypes.c_uint64(THRESHOLD_BYTES), ctypes.c_uint64(cap or 0),
                                       ctypes.c_uint64(huge))
    _cache_installed = code in (0, 1)
    _huge_pages = _cache_installed and huge > 0
    if code == 2:
        logging.getLogger("dsrun").warning("dsrun: the caching host allocator was not installed: torch's CPU "
                                           "allocator was replaced by one without a raw deleter")


def adopt_parameters(params) -> int:
    """Move large CPU parameters into memory from the caching host allocator.

    A model built before dsrun started holds its parameters where torch's
    default allocator put them, on 4 KiB pages. ZeRO stages 1-3 copy them
    into flat buffers of their own; where they stay in place (stage 0 in
    fp32) this gives each parameter of THRESHOLD_BYTES or more a fresh copy
    from the allocator (2 MiB pages: see [Note: huge pages] in
    csrc/host_alloc) and points `p.data` at it, one parameter at a time (peak:
    one parameter more). Skipped: a parameter that is not contiguous, does
    not own its whole storage, or whose storage another tensor shares (a
    view kept elsewhere), so no alias breaks; and one already 2 MiB-aligned
    (allocated by dsrun). Nothing happens unless the cache is installed with
    huge pages on. Returns the bytes moved.
    """
    if not _huge_pages:
        return 0
    import torch

    moved = 0
    with torch.no_grad():
        for p in params:
            nbytes = p.numel() * p.element_size()
            if p.device.type != "cpu" or nbytes < THRESHOLD_BYTES or not p.is_contiguous() \
                    or p.data_ptr() % HUGE_BYTES == 0:
                continue
            storage = p.untyped_storage()
            # Two references: the parameter's and `storage`'s own; more is an alias.
            shared = storage.nbytes() != nbytes or torch._C._storage_Use_Count(storage._cdata) > 2
            del storage
            if not shared:
                p.data = torch.empty_like(p).copy_(p)
                moved += nbytes
    return moved


STATS = ("cached_bytes", "hits", "misses", "live_bytes", "peak_live_bytes", "cap_bytes")


def cache_stats() -> dict[str, int]:
    """The caching host allocator's counters: bytes cached now, requests
    served from the cache (hits) and from fresh mappings (misses), bytes of
    large blocks live now and their peak since the last `trim()`, the cap from
    DSRUN_HOST_CACHE_MB in bytes (0: none). All zero when it is not installed."""
    out = (ctypes.c_uint64 * len(STATS))()
    if _cache_installed:
        from dsrun.ops.builder import get_op

        get_op("host_alloc").load().dsrun_host_alloc_stats(out)
    return dict(zip(STATS, (int(v) for v in out)))


def cached_bytes() -> int | None:
    """Bytes the caching host allocator holds for reuse now (counted in RSS,
    not live in any tensor); None when it is not installed."""
    return cache_stats()["cached_bytes"] if _cache_installed else None


def trim() -> None:
    """Give freed host memory back to the kernel: the caching host
    allocator's blocks and the heap's free pages (glibc malloc_trim; no-op
    elsewhere)."""
    if _cache_installed:
        from dsrun.ops.builder import get_op

        get_op("host_alloc").load().dsrun_host_alloc_release()
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)

"""The caching host allocator (csrc/host_alloc, [Note: caching host allocator]
in dsrun/runtime/memory/allocator.py): freed large CPU blocks are reused without
page faults, cached plus live bytes stay under the peak of live bytes
(and the cap), `trim()` empties it, blocks of 2 MiB or more sit on
transparent huge pages, and kernels that use torch's raw allocation path
still work.

Each case runs in a fresh process, a one-rank `run_ranks` (forked from the
torch-loaded server, [Note: ranks forked from a torch-loaded server] in
tests/dist_helpers.py, where nothing installed the allocator): the allocator is
installed for a whole process, once.
"""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests.dist_helpers import RankFailed, run_ranks

NUMEL = 3_150_000  # 12.6 MB of fp32: a unit of the 48M GPT
PAGES = -(-NUMEL * 4 // 4096)
BLOCK = PAGES * 4096  # bytes: sizes are rounded up to whole pages


def _exec(code: str, env: dict[str, str]) -> dict:
    """The rank: `code` run with `env` added to the environment; returns its `out`."""
    os.environ.update(env)
    scope: dict = {}
    exec(code, scope)
    return scope["out"]


def _in_fresh_process(code: str, **env: str) -> dict:
    return run_ranks(_exec, 1, code, {"DSRUN_MALLOC": "1", **env}, timeout=300)[0]


def _run(body: str, **env: str) -> dict:
    code = textwrap.dedent("""
        import resource, threading, torch
        from dsrun.runtime.memory import allocator
        installed = allocator.use_returning_allocator()
        def faults():
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = {"installed": installed}
    """) + textwrap.dedent(body)
    return _in_fresh_process(code, **env)


REUSE = f"""
    n = {NUMEL}
    x = torch.zeros(n); x.abs().max(); del x  # the first two blocks: fresh mappings
    before = faults()
    for i in range(20):
        x = torch.zeros(n)   # a reused block still comes back zeroed
        assert float(x.abs().max()) == 0.0
        x.fill_(float(i))
        del x
    out["faults"] = faults() - before
    out["stats"] = allocator.cache_stats()
"""


def test_freed_blocks_are_reused_without_page_faults():
    r = _run(REUSE)
    assert r["installed"]
    assert r["stats"]["misses"] <= 2 and r["stats"]["hits"] >= 20, r["stats"]  # x and x.abs()
    assert r["stats"]["cached_bytes"] >= NUMEL * 4
    # 20 cycles of two 3076-page tensors: fresh mappings would fault every page each time.
    assert r["faults"] < PAGES // 2, r["faults"]


def test_without_the_cache_every_cycle_faults_again():
    r = _run(REUSE, DSRUN_HOST_CACHE_MB="0")
    assert r["installed"]  # the mmap threshold alone is in effect
    assert set(r["stats"].values()) == {0}, r["stats"]
    assert r["faults"] > 10 * PAGES, r["faults"]


def test_cache_never_holds_more_than_the_peak_of_live_bytes():
    r = _run(f"""
        blocks = [torch.ones({NUMEL}) for _ in range(4)]  # 4 x 12.6 MB live: the peak
        del blocks                                         # all four cached: still under the peak
        out["freed"] = allocator.cache_stats()
        y = torch.ones(20 << 20, dtype=torch.uint8)        # another size: cached blocks make room for it
        out["other_size"] = allocator.cache_stats()
        del y
        allocator.trim()
        out["trimmed"] = allocator.cache_stats()
    """)
    block = BLOCK
    f, o, t = r["freed"], r["other_size"], r["trimmed"]
    assert f["peak_live_bytes"] == 4 * block and f["live_bytes"] == 0 and f["cached_bytes"] == 4 * block, f
    assert o["live_bytes"] == 20 << 20 and o["live_bytes"] + o["cached_bytes"] <= o["peak_live_bytes"], o
    assert o["cached_bytes"] == 2 * block, o  # two evicted: 20 MiB + 3 blocks would pass the peak
    assert t["cached_bytes"] == 0 and t["peak_live_bytes"] == t["live_bytes"], t


def test_cap_from_the_environment():
    r = _run(f"""
        blocks = [torch.ones({NUMEL}) for _ in range(4)]
        del blocks
        out["stats"] = allocator.cache_stats()
    """, DSRUN_HOST_CACHE_MB="30")
    assert r["stats"]["cap_bytes"] == 30 << 20 and r["stats"]["cached_bytes"] == 2 * BLOCK, r["stats"]


def test_raw_allocation_and_frees_from_another_thread():
    r = _run(f"""
        a = torch.randn(1024, 1024, dtype=torch.bfloat16)
        b = torch.randn(1024, 1024, dtype=torch.bfloat16)
        ref = (a.float() @ b.float())
        out["err"] = float(((a @ b).float() - ref).abs().max() / ref.abs().max())  # bf16 matmul: raw allocations
        keep = [torch.ones({NUMEL})]
        t = threading.Thread(target=keep.clear); t.start(); t.join()  # freed on another thread
        y = torch.ones({NUMEL})
        out["sum"] = float(y.sum())
        out["stats"] = allocator.cache_stats()
    """)
    assert r["err"] < 0.05 and r["sum"] == NUMEL
    assert r["stats"]["hits"] >= 1


def _thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise, never (or unknown)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


HUGE = """
    x = torch.ones(64 << 20, dtype=torch.uint8)  # every page touched
    ptr = x.data_ptr()
    out["aligned"] = ptr % (2 << 20) == 0
    huge, inside = 0, False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:  # a mapping's header line: start-end perms ...
            lo, hi = (int(v, 16) for v in first.split("-"))
            inside = lo <= ptr < hi
        elif inside and first == "AnonHugePages:":
            huge += int(line.split()[1]) << 10
    out["huge_bytes"] = huge
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_large_blocks_sit_on_huge_pages():
    """[Note: huge pages] in csrc/host_alloc: 2 MiB-aligned, advised, backed
    by 2 MiB pages where the kernel allows them; DSRUN_HOST_HUGEPAGES=0 keeps
    4 KiB pages."""
    r = _run(HUGE)
    assert r["installed"] and r["aligned"]
    if _thp_mode() in ("madvise", "always"):
        assert r["huge_bytes"] >= 32 << 20, r  # most of the 64 MiB (compaction may miss a few)
    off = _run(HUGE, DSRUN_HOST_HUGEPAGES="0")
    if _thp_mode() == "madvise":  # with "always" the kernel uses huge pages unasked
        assert off["huge_bytes"] == 0, off


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_a_block_just_under_2_mib_takes_a_whole_huge_page():
    """block_bytes in csrc/host_alloc: a 704 x 704 fp32 weight (1.98 MB) is
    served by one 2 MiB block (an eighth or less added), a 1.5 MiB tensor by
    its own whole pages; with huge pages off, whole 4 KiB pages only."""
    body = """
        a = torch.ones(704, 704)
        out["after_a"] = allocator.cache_stats()["live_bytes"]
        out["a_aligned"] = a.data_ptr() % (2 << 20) == 0
        b = torch.ones(3 << 18, dtype=torch.float16)  # 1.5 MiB
        out["after_b"] = allocator.cache_stats()["live_bytes"]
    """
    r = _run(body)
    assert r["after_a"] == 2 << 20 and r["a_aligned"], r
    assert r["after_b"] - r["after_a"] == 3 << 19, r  # 1.5 MiB: rounding would add a third
    off = _run(body, DSRUN_HOST_HUGEPAGES="0")
    assert off["after_a"] == -(-704 * 704 * 4 // 4096) * 4096, off


def test_adopt_parameters_moves_only_unaliased_large_ones():
    """allocator.adopt_parameters (stage 0 keeps parameters in place): a large
    parameter built before the allocator moves into a 2 MiB-aligned block with
    its values; one whose storage a kept view shares, and a small one, stay."""
    code = textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        big, shared, small = (torch.nn.Parameter(torch.randn(n)) for n in (600_000, 600_000, 1000))
        view = shared[:10]  # another tensor on shared's storage
        values = [p.detach().clone() for p in (big, shared, small)]
        before = [p.data_ptr() for p in (big, shared, small)]
        from dsrun.runtime.memory import allocator
        allocator.use_returning_allocator()
        moved = allocator.adopt_parameters([big, shared, small])
        out = {"moved": moved, "big_aligned": big.data_ptr() % (2 << 20) == 0,
               "same": [p.data_ptr() == b for p, b in zip((big, shared, small), before)],
               "equal": all(torch.equal(p, v) for p, v in zip((big, shared, small), values)),
               "view_follows": view.data_ptr() == shared.data_ptr()}
    """)
    r = _in_fresh_process(code)
    assert r["moved"] == 2_400_000 and r["big_aligned"] and r["same"] == [False, True, True], r
    assert r["equal"] and r["view_follows"], r


@pytest.mark.parametrize("variable,value,words", [("DSRUN_HOST_CACHE_MB", v, "whole number") for v in
                                                  ("abc", "-1", "1.5")] + [("DSRUN_HOST_HUGEPAGES", "yes", "1")])
def test_bad_environment_is_a_clear_error(variable, value, words):
    code = "from dsrun.runtime.memory import allocator; allocator.use_returning_allocator()"
    with pytest.raises(RankFailed) as failed:
        _in_fresh_process(code, **{variable: value})
    message = str(failed.value)
    assert variable in message and words in message, message

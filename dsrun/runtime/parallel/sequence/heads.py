"""Which attention heads each rank of a Ulysses sequence group takes: query
heads split as evenly as whole heads allow, the key/value heads those
query heads use, and how the local query heads map onto them.

[Note: heads the sequence-parallel size does not divide]
Ulysses (Jacobs et al. 2023, arXiv 2309.14509) gives each of the P ranks
h/P whole heads, so P must divide h. With h = qP + s (0 < s < P) rank r
takes q + 1 heads for r < s and q otherwise, contiguous and in rank order
(torch.tensor_split's rule), and the all-to-alls carry blocks of unequal
sizes (all_to_all_single with split sizes). The other way, padding h to
P ceil(h/P) heads with zeros that are dropped after the exchange, gives
the busiest rank the same q + 1 heads to receive and attend over, so it
shortens nothing, while every rank sends P ceil(h/P) / h times the bytes
(8/6 for 6 heads on 4 ranks) and holds padded copies of q, k, v and the
output. bench/sequence/uneven_heads.py measures both against P dividing
the heads.

Grouped-query attention (h_kv key/value heads, h_kv dividing h, query
head i using key/value head i // (h / h_kv)): rank r receives exactly the
key/value heads its query heads use, the contiguous range from the first
one's to the last one's. A key/value head whose query heads straddle two
ranks goes to both (as DeepSpeed repeats key/value heads when h_kv < P),
and the gradients of the copies are summed on the way back. Locally,
query head i then uses received key/value head m_i; when that is the
usual grouped pattern (m_i = i // (local ratio)) the local attention gets
the received heads as they are, otherwise (e.g. query heads 0-4 with
groups of 3: m = 0 0 0 1 1) the key/value heads are repeated to one per
query head. P must not exceed h: a rank without a query head would have
nothing to compute.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

Range = tuple[int, int]  # [start, stop) of heads


@dataclass(frozen=True)
class HeadPlan:
    """The heads of every rank of a sequence group of P ranks.

    Attributes:
        query: per rank, its [start, stop) of the h query heads.
        kv: per rank, its [start, stop) of the h_kv key/value heads (ranges
            of neighbouring ranks may overlap by one head).
        kv_index: per rank, None when its local heads form ordinary grouped
            attention, else the received key/value head of each local query
            head (a tuple of indices, for index_select on the head dim).
    """
    query: tuple[Range, ...]
    kv: tuple[Range, ...]
    kv_index: tuple[tuple[int, ...] | None, ...]


def _local_index(start: int, stop: int, group: int) -> tuple[Range, tuple[int, ...] | None]:
    """Key/value heads [lo, hi) used by query heads [start, stop) with
    `group` query heads per key/value head, and the local index of each
    query head's key/value head when it is not the usual grouped pattern."""
    lo, hi = start // group, (stop - 1) // group + 1
    used = tuple(i // group - lo for i in range(start, stop))
    count, kv = stop - start, hi - lo
    if count % kv == 0 and all(m == i // (count // kv) for i, m in enumerate(used)):
        return (lo, hi), None
    return (lo, hi), used


def query_heads(heads: int, world: int) -> tuple[Range, ...]:
    """Each rank's [start, stop) of `heads` query heads: the first heads % P
    ranks take one more than the others."""
    base, extra = divmod(heads, world)
    stops = [sum(base + (r < extra) for r in range(rank + 1)) for rank in range(world)]
    return tuple(zip([0] + stops[:-1], stops))


@functools.lru_cache(maxsize=64)
def plan_heads(heads: int, kv_heads: int, world: int) -> HeadPlan:
    """Split h query and h_kv key/value heads over `world` ranks ([Note:
    heads the sequence-parallel size does not divide]).

    Args:
        heads: h, query heads (> 0).
        kv_heads: h_kv, key/value heads; must divide h.
        world: P, ranks of the sequence-parallel group.

    Raises:
        ValueError: P > h (some rank would get no query head; the message
            gives both numbers), or h_kv does not divide h.
    """
    if world > heads:
        raise ValueError(f"DistributedAttention: {heads} query head{'s' * (heads != 1)} over {world} "
                         "sequence-parallel ranks: every rank needs at least one whole query head; use a "
                         f"sequence_parallel_size of at most {heads}")
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"DistributedAttention: {heads} query heads and {kv_heads} key/value heads: "
                         "grouped-query attention needs the key/value heads to divide the query heads")
    query = query_heads(heads, world)
    local = [_local_index(start, stop, heads // kv_heads) for start, stop in query]
    return HeadPlan(query=query, kv=tuple(kv for kv, _ in local), kv_index=tuple(index for _, index in local))

"""Splitting a sequence of layers into contiguous parts (pipeline stages).

Both functions return boundaries in DeepSpeed's form (`PipelineModule.parts`):
a list `parts` of length num_parts + 1 with parts[0] = 0 and
parts[-1] = num_items, part j holding items parts[j] .. parts[j + 1] - 1.
Every part holds at least one item.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["partition_balanced", "partition_uniform"]


def _check_counts(num_items: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"cannot split into {num_parts} parts: the number of parts must be at least 1")
    if num_items < num_parts:
        raise ValueError(f"cannot split {num_items} layers into {num_parts} parts: every pipeline part needs "
                         f"at least one layer; use fewer stages (or virtual stages) or more layers")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries that give each part num_items // num_parts items, the first
    num_items % num_parts parts one more (DeepSpeed's uniform split).

    Raises:
        ValueError: num_parts < 1, or fewer items than parts.
    """
    _check_counts(num_items, num_parts)
    size, extra = divmod(num_items, num_parts)
    parts = [0]
    for j in range(num_parts):
        parts.append(parts[-1] + size + (1 if j < extra else 0))
    return parts


def _parts_needed(weights: Sequence[int], bottleneck: int) -> int:
    """The fewest contiguous parts whose sums are all <= bottleneck (each
    weight must be <= bottleneck); filling each part as far as it goes is
    optimal for non-negative weights."""
    count, load = 1, 0
    for w in weights:
        if load + w > bottleneck:
            count, load = count + 1, 0
        load += w
    return count


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous, non-empty parts minimising the heaviest part's total weight.

    This is the linear partition problem with a min-max objective. The
    smallest feasible bottleneck B is found by binary search over the
    integers in [max(weights), sum(weights)]: B is feasible when greedily
    filling parts up to B needs at most num_parts parts (with non-empty
    parts, a feasible split into fewer parts can always be split further
    without raising the maximum). The boundaries are then drawn greedily
    from the left: each part takes layers while its sum stays <= B and
    enough layers remain for one per later part. Cost O(n log sum(weights)).

    When every weight is zero the split is uniform.

    Args:
        weights: one non-negative integer per item (e.g. trainable parameter
            counts of the layers, or 1/0 for "is a transformer block").
        num_parts: the number of parts (pipeline stages times virtual stages).

    Returns:
        The boundaries, a list of num_parts + 1 ints (see the module docstring).

    Raises:
        ValueError: a weight is negative or not an integer, num_parts < 1,
            or fewer items than parts.
    """
    weights = list(weights)
    _check_counts(len(weights), num_parts)
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"partition weight {i} is {w!r}: weights must be non-negative integers")
    if sum(weights) == 0:
        return partition_uniform(len(weights), num_parts)
    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if _parts_needed(weights, mid) <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    bottleneck = lo
    n = len(weights)
    parts = [0]
    for j in range(num_parts - 1):
        stop, load = parts[-1], 0
        latest_stop = n - (num_parts - 1 - j)  # leave one item for each later part
        while stop < latest_stop and (stop == parts[-1] or load + weights[stop] <= bottleneck):
            load += weights[stop]
            stop += 1
        parts.append(stop)
    parts.append(n)
    return parts

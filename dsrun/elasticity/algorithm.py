"""DeepSpeed's elastic batch-size search (versions 0.1 and 0.2), as plain arithmetic.

Re-derived from DeepSpeed's `deepspeed/elasticity/elasticity.py` (v0.16,
functions `get_candidate_batch_sizes`, `get_valid_gpus`,
`get_best_candidates`, `_get_compatible_gpus_v01`, `_get_compatible_gpus_v02`)
so that the same inputs give the same batch size, world sizes and
micro-batch. Nothing here reads a config: dsrun/elasticity/compute.py
validates the `elasticity` section and calls these functions.

[Note: the elastic batch search]
An elastic job keeps one global batch size B on every world size it may
run on, by changing gradient accumulation: B = micro-batch x accumulation
steps x data-parallel size. A world size n works when some allowed
micro-batch m divides B and n divides B / m. Version 0.1 chooses B among a
few candidates, each a base (every micro-batch, and their least common
multiple) scaled by the largest highly composite number that keeps it
within max_train_batch_size (highly composite numbers have more divisors
than any smaller number, so B / m has many divisors, i.e. many world
sizes). The candidate with the most valid world sizes in [min_gpus,
max_gpus] wins; ties go to the larger batch (prefer_larger_batch) or the
smaller. Version 0.2 runs the same search per node (data-parallel ranks per
node = num_gpus_per_node / model_parallel_size) and, when the current job
is not one of the sizes found, instead picks the largest (or smallest)
multiple of micro-batch x data-parallel size within max_train_batch_size
for that job alone.
"""
from __future__ import annotations

import math
from fractions import Fraction

from dsrun.elasticity.errors import ElasticityConfigError, ElasticityError

# The 38 smallest highly composite numbers (OEIS A002182), the scale factors
# of version 0.1: enough for batch sizes up to 720720 x the base.
HIGHLY_COMPOSITE_NUMBERS = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
    15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
    498960, 554400, 665280, 720720,
)


def candidate_batch_sizes(bases: list[int], max_batch_size: int) -> set[int]:
    """The candidate global batch sizes of version 0.1, one per base.

    Each base below `max_batch_size` is scaled by the largest number of
    HIGHLY_COMPOSITE_NUMBERS that keeps it within `max_batch_size` (720720
    when even that fits); a base at or above `max_batch_size` is its own
    candidate, so the least common multiple of the micro-batches can yield
    a candidate above `max_batch_size`, as in DeepSpeed.

    Args:
        bases: positive integers (samples): the micro-batch sizes and their
            least common multiple.
        max_batch_size: max_train_batch_size, samples.
    """
    found = set()
    for base in bases:
        if base >= max_batch_size:
            found.add(base)
            continue
        limit = max_batch_size // base
        found.add(base * max(h for h in HIGHLY_COMPOSITE_NUMBERS if h <= limit))
    return found


def valid_world_sizes(batch_size: int, micro_batches: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    """The data-parallel sizes in [min_gpus, max_gpus] that can run `batch_size`.

    A size n is valid when some micro-batch m divides `batch_size` and n
    divides batch_size / m (the accumulation steps are then
    batch_size / (m x n)).

    Returns:
        The valid sizes, ascending, without repeats (possibly empty).
    """
    sizes = set()
    for micro in micro_batches:
        if batch_size % micro:
            continue
        replicas = batch_size // micro  # ranks that would each run one micro-batch per step
        sizes.update(n for n in _divisors(replicas) if min_gpus <= n <= max_gpus)
    return sorted(sizes)


def _divisors(value: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(value) + 1) if value % d == 0]
    return small + [value // d for d in reversed(small) if d * d != value]


def best_batch_size(candidates: set[int], micro_batches: list[int], min_gpus: int, max_gpus: int,
                    prefer_larger: bool) -> tuple[int, list[int] | None]:
    """The candidate with the most valid world sizes; ties go to the larger
    candidate when `prefer_larger`, else to the smaller.

    Returns:
        (batch size, its valid world sizes ascending). When no candidate has
        a valid world size in [min_gpus, max_gpus], DeepSpeed's fallback:
        (the largest candidate, []) when prefer_larger and that candidate
        exceeds min(micro_batches), else (min(micro_batches), None).
    """
    scored = [(len(valid_world_sizes(b, micro_batches, min_gpus, max_gpus)), b if prefer_larger else -b, b)
              for b in candidates]
    count, _, batch = max(scored)
    if count:
        return batch, valid_world_sizes(batch, micro_batches, min_gpus, max_gpus)
    if prefer_larger and max(candidates) > min(micro_batches):
        return max(candidates), []
    return min(micro_batches), None


def compatible_gpus_v01(micro_batches: list[int], max_batch_size: int, min_gpus: int, max_gpus: int,
                        prefer_larger: bool) -> tuple[int, list[int]]:
    """Version 0.1: the global batch size and the world sizes that can run it.

    Args:
        micro_batches: allowed micro-batch sizes per rank, samples (positive).
        max_batch_size: max_train_batch_size, samples.
        min_gpus, max_gpus: the range of world sizes to count; 0 means 1
            and max_batch_size // min(micro_batches), as in DeepSpeed
            (version 0.2 can pass 0 after dividing by the node size).
        prefer_larger: on a tie in the number of world sizes, take the
            larger batch size.

    Returns:
        (global batch size, valid world sizes ascending, not empty). See
        [Note: the elastic batch search].

    Raises:
        ElasticityConfigError: a micro-batch exceeds max_batch_size, or no
            world size in the range works (DeepSpeed returns an empty or
            None list there, which no job can use).
    """
    batch, valid = _search(micro_batches, max_batch_size, min_gpus, max_gpus, prefer_larger)
    if not valid:
        raise _no_world_size(micro_batches, max_batch_size, min_gpus, max_gpus)
    return batch, valid


def _search(micro_batches: list[int], max_batch_size: int, min_gpus: int, max_gpus: int,
            prefer_larger: bool) -> tuple[int, list[int] | None]:
    """compatible_gpus_v01 with DeepSpeed's empty results (see best_batch_size)."""
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_batch_size // min(micro_batches)
    too_big = [m for m in micro_batches if m > max_batch_size]
    if too_big:
        raise ElasticityConfigError(
            f"elasticity: micro_batch_sizes {too_big} exceed the largest batch allowed, {max_batch_size}; "
            f"every micro-batch must be at most max_train_batch_size (in version 0.2, at most "
            f"max_train_batch_size / data-parallel ranks per node)")
    bases = [*micro_batches, math.lcm(*micro_batches)]
    return best_batch_size(candidate_batch_sizes(bases, max_batch_size), micro_batches, min_gpus, max_gpus,
                           prefer_larger)


def _no_world_size(micro_batches: list[int], max_batch_size: int, min_gpus: int, max_gpus: int,
                   counted: str = "world size") -> ElasticityConfigError:
    return ElasticityConfigError(
        f"elasticity: no {counted} from {min_gpus or 1} (min_gpus) to {max_gpus or 'any'} (max_gpus) can "
        f"run a batch of at most {max_batch_size} samples with micro_batch_sizes={micro_batches}; widen "
        f"the range or change max_train_batch_size")


def compatible_gpus_v02(micro_batches: list[int], max_batch_size: int, num_gpus: int, min_gpus: int,
                        max_gpus: int, prefer_larger: bool, num_gpus_per_node: int,
                        model_parallel_size: int) -> tuple[int, list[int], int | None]:
    """Version 0.2: the version-0.1 search counted in nodes, with a fallback
    for a job size the search does not allow.

    The search runs with max_batch_size / d, min_gpus / num_gpus_per_node
    and max_gpus / num_gpus_per_node (each rounded down), where d =
    num_gpus_per_node / model_parallel_size is the data-parallel ranks per
    node; its batch size and world sizes are then multiplied by d. When
    num_gpus / model_parallel_size is not among those sizes (or the search
    found none, which DeepSpeed allows here), the batch is
    instead the largest multiple of m x p within max_batch_size over the
    micro-batches m (the smallest such largest multiple when not
    prefer_larger), with p = num_gpus / num_gpus_per_node x d and p the one
    valid size (rounded down). The arithmetic is exact (DeepSpeed uses
    floats; they agree wherever p is a whole number).

    Args:
        num_gpus: the job's size (the world_size given to
            compute_elastic_config, or WORLD_SIZE).
        num_gpus_per_node, model_parallel_size: as in the config; the first
            must be a multiple of the second.
        Others: as for compatible_gpus_v01.

    Returns:
        (global batch size, valid data-parallel sizes ascending, micro-batch
        for num_gpus or None when no allowed micro-batch divides
        batch // num_gpus).

    Raises:
        ElasticityError: num_gpus_per_node is not a multiple of
            model_parallel_size.
        ElasticityConfigError: as compatible_gpus_v01.
    """
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(
            f"elasticity version 0.2: num_gpus_per_node={num_gpus_per_node} is not a multiple of "
            f"model_parallel_size={model_parallel_size}; a model replica must fit inside a node")
    per_node = num_gpus_per_node // model_parallel_size  # data-parallel ranks per node
    node_min, node_max = min_gpus // num_gpus_per_node, max_gpus // num_gpus_per_node
    nodes_batch, node_counts = _search(micro_batches, max_batch_size // per_node, node_min, node_max,
                                       prefer_larger)
    if node_counts is None:  # DeepSpeed fails here with a TypeError
        raise _no_world_size(micro_batches, max_batch_size // per_node, node_min, node_max,
                             f"node count (of {num_gpus_per_node} GPUs)")
    batch = nodes_batch * per_node
    valid = [n * per_node for n in node_counts]
    if num_gpus // model_parallel_size in valid:
        return batch, valid, _micro_batch_for(batch, num_gpus, micro_batches, prefer_larger)

    data_parallel = Fraction(num_gpus, num_gpus_per_node) * per_node
    multiples = [math.floor(max_batch_size / (m * data_parallel)) * m * data_parallel for m in micro_batches]
    chosen = max(multiples) if prefer_larger else min(multiples)
    return int(chosen), [int(data_parallel)], _micro_batch_for(chosen, num_gpus, micro_batches, prefer_larger)


def _micro_batch_for(batch_size: int | Fraction, num_gpus: int, micro_batches: list[int],
                     prefer_larger: bool) -> int | None:
    """Version 0.2's micro-batch: among the micro-batches dividing
    batch_size // num_gpus, the largest when prefer_larger, else the first
    in the config's order; None when none divides."""
    fitting = [m for m in micro_batches if (batch_size // num_gpus) % m == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def largest_micro_batch(batch_size: int, world_size: int, micro_batches: list[int]) -> int | None:
    """The largest allowed micro-batch dividing batch_size // world_size (what
    compute_elastic_config returns for a given world size), or None."""
    fitting = [m for m in set(micro_batches) if (batch_size // world_size) % m == 0]
    return max(fitting, default=None)

"""Stage-3 settings as frozen policy objects, built once from the config.

As FSDP2 passes `MixedPrecisionPolicy` and `OffloadPolicy` to
`fully_shard` instead of loose arguments, the stage-3 strategy takes two
policies: `GatherPolicy`, what its gather schedule and unit plan read
(schedule.py, stage3.py [Note: units]), and `ZeroPPPolicy`, the ZeRO++
communication options (Wang et al. 2023, "ZeRO++: Extremely Efficient
Collective Communication for Giant Model Training": qwZ, hpZ, qgZ).
Both are checked when built, so a strategy never sees a negative size or
a size given as a boolean. This module imports nothing from zero/: every
other module there may use it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

QWZ_BLOCK = 256  # elements per int8 block of ZeRO++ qwZ (4 bytes of scale per 256 values)
QGZ_BLOCK = 128  # elements per int4 block of ZeRO++ qgZ: 64 bytes of codes + 4 of scale (0.53 B/element)


def _check_counts(policy: Any, minimum: dict[str, int]) -> None:
    """Raise ValueError naming the first field of `minimum` that is not an
    int (booleans refused) of at least its minimum."""
    for name, low in minimum.items():
        value = getattr(policy, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{type(policy).__name__}.{name} must be an integer >= {low}, got {value!r}")


def _check_flags(policy: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(policy, name)
        if not isinstance(value, bool):
            raise ValueError(f"{type(policy).__name__}.{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class GatherPolicy:
    """When stage 3 gathers, keeps and frees parameters (DeepSpeed's `stage3_*` knobs).

    Attributes:
        prefetch_numel: elements of units gathered ahead of their use along
            the recorded fetch trace (stage3_prefetch_bucket_size); see
            [Note: the fetch trace] in schedule.py.
        max_live_numel: most elements of non-persistent units gathered at
            once; prefetching stops and kept units are evicted at it
            (stage3_max_live_parameters).
        max_reuse_distance: a unit whose next use comes within fewer than
            this many elements of other fetches (and within the prefetch
            window) stays gathered after use (stage3_max_reuse_distance).
        persistence_threshold: parameters of fewer elements join the
            persistent unit, gathered after every step and never freed
            (stage3_param_persistence_threshold) ...
        model_persistence_threshold: ... while the persistent unit's total
            stays within this many elements (stage3_model_persistence_threshold).
        unit_patterns: fnmatch patterns of module names or class names that
            make a module a gather unit (stage3_unit_modules); None = each
            element of an nn.ModuleList / nn.Sequential (stage3.py
            [Note: units]). Modules marked by `set_z3_leaf_modules` are
            units whatever the patterns.

    Raises:
        ValueError: a size is negative or not an integer, or a pattern is
            not a string.
    """

    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    unit_patterns: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _check_counts(self, {f.name: 0 for f in fields(self) if f.name != "unit_patterns"})
        if self.unit_patterns is not None:
            patterns = tuple(self.unit_patterns)
            if not all(isinstance(p, str) for p in patterns):
                raise ValueError(f"GatherPolicy.unit_patterns must be strings, got {self.unit_patterns!r}")
            object.__setattr__(self, "unit_patterns", patterns)  # a list from the config: held immutable

    @classmethod
    def from_config(cls, config: Any) -> GatherPolicy:
        """From a DsConfig's `zero_optimization` section."""
        zero = config.zero_optimization
        return cls(prefetch_numel=zero.stage3_prefetch_bucket_size,
                   max_live_numel=zero.stage3_max_live_parameters,
                   max_reuse_distance=zero.stage3_max_reuse_distance,
                   persistence_threshold=zero.stage3_param_persistence_threshold,
                   model_persistence_threshold=zero.stage3_model_persistence_threshold,
                   unit_patterns=zero.stage3_unit_modules)


@dataclass(frozen=True)
class ZeroPPPolicy:
    """ZeRO++'s communication options for stage 3 (all off by default).

    Attributes:
        quantized_weights: qwZ (zero_quantized_weights): the training
            all-gathers (forward, backward, their prefetches) send block-wise
            int8, QWZ_BLOCK elements per fp32 scale; with hpZ the backward
            ones come exact from the secondary partition.
        quantized_gradients: qgZ (zero_quantized_gradients): gradients are
            reduce-scattered by the hierarchical int4 all-to-all over the
            node groups, QGZ_BLOCK elements per fp32 scale.
        hpz_partition_size: hpZ (zero_hpz_partition_size), in ranks: 1 =
            off; h > 1 keeps a secondary partition over blocks of h
            consecutive ranks (one node or a part of it) and gathers for
            backward from it (unit.py [Note: hpZ secondary partition]).
        quantized_nontrainable_weights: zero_quantized_nontrainable_weights:
            frozen parameters' shards are kept as int8 (QWZ_BLOCK elements per
            fp32 scale), quantized once, and gathered as that int8.

    Raises:
        ValueError: a flag is not a boolean, or hpz_partition_size < 1.
    """

    quantized_weights: bool = False
    quantized_gradients: bool = False
    hpz_partition_size: int = 1
    quantized_nontrainable_weights: bool = False

    def __post_init__(self) -> None:
        _check_flags(self, ("quantized_weights", "quantized_gradients", "quantized_nontrainable_weights"))
        _check_counts(self, {"hpz_partition_size": 1})

    @property
    def weight_block(self) -> int:
        """Elements per int8 block of a training all-gather; 0 = exact."""
        return QWZ_BLOCK if self.quantized_weights else 0

    @property
    def frozen_block(self) -> int:
        """Elements per int8 block of a frozen parameter's shard; 0 = kept in the compute dtype."""
        return QWZ_BLOCK if self.quantized_nontrainable_weights else 0

    @classmethod
    def from_config(cls, config: Any) -> ZeroPPPolicy:
        """From a DsConfig's `zero_optimization` section."""
        zero = config.zero_optimization
        return cls(quantized_weights=zero.zero_quantized_weights,
                   quantized_gradients=zero.zero_quantized_gradients,
                   hpz_partition_size=zero.zero_hpz_partition_size,
                   quantized_nontrainable_weights=zero.zero_quantized_nontrainable_weights)

"""The batch sizes an elastic job runs with: the search of algorithm.py for one
validated `elasticity` section, and the engine's batch triple from it."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsrun.elasticity.algorithm import (
    compatible_gpus_v01,
    compatible_gpus_v02,
    largest_micro_batch,
)
from dsrun.elasticity.errors import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)


def search(elasticity: Any, num_gpus: int) -> tuple[int, list[int], int | None]:
    """Run the search of the section's version (see [Note: the elastic batch search]).

    Args:
        elasticity: a validated `elasticity` section
            (dsrun.runtime.config.ElasticityConfig).
        num_gpus: the job's size; only version 0.2 uses it.

    Returns:
        (global batch size in samples, valid world sizes ascending,
        version 0.2's micro-batch for num_gpus or None; None for 0.1).
    """
    if elasticity.version == 0.1:
        batch, valid = compatible_gpus_v01(elasticity.micro_batch_sizes, elasticity.max_train_batch_size,
                                           elasticity.min_gpus, elasticity.max_gpus,
                                           elasticity.prefer_larger_batch)
        return batch, valid, None
    return compatible_gpus_v02(elasticity.micro_batch_sizes, elasticity.max_train_batch_size, num_gpus,
                               elasticity.min_gpus, elasticity.max_gpus, elasticity.prefer_larger_batch,
                               elasticity.num_gpus_per_node, elasticity.model_parallel_size)


def micro_batch_for(batch_size: int, valid: list[int], world_size: int, micro_batches: list[int]) -> int:
    """The micro-batch a job of `world_size` ranks runs: the largest allowed
    micro-batch dividing batch_size // world_size.

    Raises:
        ElasticityIncompatibleWorldSize: world_size is not in `valid`; the
            message lists the valid sizes.
        ElasticityError: no allowed micro-batch divides the per-rank batch
            (DeepSpeed fails an assert there).
    """
    if world_size not in valid:
        raise ElasticityIncompatibleWorldSize(
            f"elasticity: world size {world_size} is not one the elastic config allows (global batch "
            f"{batch_size}); run on one of {valid}, or change micro_batch_sizes, max_train_batch_size or "
            f"min_gpus/max_gpus", world_size, tuple(valid))
    micro = largest_micro_batch(batch_size, world_size, micro_batches)
    if micro is None:
        raise ElasticityError(
            f"elasticity: none of micro_batch_sizes={micro_batches} divides the per-rank batch "
            f"{batch_size} // {world_size} = {batch_size // world_size}; change micro_batch_sizes")
    return micro


def elastic_batch_triple(config: Any, world_size: int, batch_keys_given: Sequence[str]) -> tuple[int, int, int]:
    """The engine's batch triple under an enabled `elasticity` section, as DeepSpeed's
    DeepSpeedConfig sets it (deepspeed/runtime/config.py, elasticity branch).

    Args:
        config: a validated DsConfig whose `elasticity` section is enabled.
        world_size: the data-parallel world size (ranks / model-parallel
            ranks), which DeepSpeed passes as compute_elastic_config's world_size.
        batch_keys_given: which of train_batch_size,
            train_micro_batch_size_per_gpu and gradient_accumulation_steps
            the config sets; they are overridden.

    Returns:
        (train_batch_size, train_micro_batch_size_per_gpu,
        gradient_accumulation_steps), with train_batch_size = micro x
        accumulation x world_size.

    Raises:
        ElasticityConfigError: batch keys are given and
            ignore_non_elastic_batch_info is false, or (version 0.2) the
            search gives a batch of 0 (micro-batch x world_size above
            max_train_batch_size).
        ElasticityIncompatibleWorldSize, ElasticityError: as micro_batch_for.
    """
    elasticity = config.elasticity
    if batch_keys_given and not elasticity.ignore_non_elastic_batch_info:
        raise ElasticityConfigError(
            f"{', '.join(batch_keys_given)}: set while elasticity is enabled, which chooses the batch sizes "
            f"itself; remove them, or set elasticity.ignore_non_elastic_batch_info to true to have them "
            f"overridden")
    batch, valid, _ = search(elasticity, world_size)
    if batch == 0:  # version 0.2 for a job whose smallest step is above max_train_batch_size
        raise ElasticityConfigError(
            f"elasticity: the version 0.2 search gives a global batch of 0 for a world size of {world_size}: "
            f"micro-batch x {world_size} exceeds max_train_batch_size={elasticity.max_train_batch_size}; "
            f"raise it, set prefer_larger_batch to true or run on fewer ranks")
    micro = micro_batch_for(batch, valid, world_size, elasticity.micro_batch_sizes)
    return batch, micro, batch // (micro * world_size)

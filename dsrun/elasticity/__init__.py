"""DeepSpeed's `deepspeed.elasticity`: elastic training's batch-size search.

`compute_elastic_config(ds_config, target_deepspeed_version, world_size=0,
return_microbatch=False)` gives the global batch size of a config's
`elasticity` section and the world sizes that can run it, as DeepSpeed does
(versions 0.1 and 0.2); the engine takes its micro-batch and gradient
accumulation from it when the section is enabled (docs/elasticity.md).
Modules: errors.py (the exceptions), algorithm.py (the search),
batch.py (the search for a validated section, the engine's batch triple),
compute.py (the public function).
"""
from dsrun.elasticity.compute import compute_elastic_config, elasticity_enabled
from dsrun.elasticity.errors import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)

__all__ = ["ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize", "compute_elastic_config",
           "elasticity_enabled"]

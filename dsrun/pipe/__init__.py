"""DeepSpeed's `deepspeed.pipe`: the pipeline module and its layer specs
(dsrun/runtime/parallel/pipe/module.py) and the topologies
(dsrun/runtime/parallel/topology.py)."""
from dsrun.runtime.parallel.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from dsrun.runtime.parallel.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                             ProcessTopology)

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology"]

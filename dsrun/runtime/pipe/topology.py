"""DeepSpeed's `deepspeed.runtime.pipe.topology` path; the code is dsrun/runtime/parallel/topology.py and grid.py."""
from dsrun.runtime.parallel.grid import PipelineParallelGrid  # noqa: F401
from dsrun.runtime.parallel.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,  # noqa: F401
                                             ProcessTopology)

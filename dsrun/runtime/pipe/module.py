"""DeepSpeed's `deepspeed.runtime.pipe.module` path; the code is dsrun/runtime/parallel/pipe/module.py."""
from dsrun.runtime.parallel.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401

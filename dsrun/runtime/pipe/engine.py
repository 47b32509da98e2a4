"""DeepSpeed's `deepspeed.runtime.pipe.engine` path; the code is dsrun/runtime/parallel/pipe/engine.py."""
from dsrun.runtime.parallel.pipe.engine import PipelineEngine  # noqa: F401

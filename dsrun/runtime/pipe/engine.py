"""DeepSpeed's `deepspeed.runtime.pipe.engine` path; the code is dsrun/runtime/engine/pipeline_engine.py."""
from dsrun.runtime.engine.pipeline_engine import PipelineEngine  # noqa: F401

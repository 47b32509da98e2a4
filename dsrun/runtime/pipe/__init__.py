"""DeepSpeed's `deepspeed.runtime.pipe` paths (module, engine, topology,
schedule) over dsrun/runtime/parallel/."""

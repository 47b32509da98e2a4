"""DeepSpeed's `deepspeed.runtime.dataloader` path; the loader lives in runtime/engine/dataloader.py."""
from dsrun.runtime.engine.dataloader import DistributedDataLoader, RepeatingLoader  # noqa: F401

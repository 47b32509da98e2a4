"""DeepSpeed's `deepspeed.runtime.pipe.schedule` path; dsrun's schedules are lists of actions
(dsrun/runtime/parallel/pipe/schedule.py)."""
from dsrun.runtime.parallel.pipe.schedule import *  # noqa: F401,F403

"""DeepSpeed's `deepspeed.runtime.lr_schedules` path; the schedules live in runtime/optim/lr_schedules.py."""
from dsrun.runtime.optim.lr_schedules import *  # noqa: F401,F403

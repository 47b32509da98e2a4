"""`deepspeed.comm.comm` (where DeepSpeed defines the API): the same names as dsrun.comm."""
from dsrun.runtime.comm.deepspeed_api import *  # noqa: F401,F403 - this module is the re-export
from dsrun.runtime.comm.deepspeed_api import __all__  # noqa: F401

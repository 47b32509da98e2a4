"""`deepspeed.comm` for scripts: `import dsrun.comm as dist` (or, with the alias
distribution, `import deepspeed.comm as dist`).

DeepSpeed's communication API with its signatures; the implementation is
dsrun/runtime/comm/deepspeed_api.py, where every collective goes through
dsrun's counted collectives.
"""
from dsrun.runtime.comm.deepspeed_api import *  # noqa: F401,F403 - this module is the re-export
from dsrun.runtime.comm.deepspeed_api import __all__  # noqa: F401

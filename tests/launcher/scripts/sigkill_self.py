"""Rank script: rank 1 kills itself with SIGKILL (as the OOM killer would); the others sleep 60 s."""
import os
import signal
import time

if os.environ["RANK"] == "1":
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)

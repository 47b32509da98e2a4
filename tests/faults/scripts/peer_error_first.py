"""Rank script: the failures arrive in the bad order, a peer's error before the root cause's death.

Rank 1 is the root cause: it catches SIGTERM, writes its pid to
rank1.pid (in the working directory) and waits; once the launcher's
teardown reaches it (the SIGTERM), it SIGKILLs itself, as the OOM killer
would. Rank 0 reads that pid, prints the error dsrun's shared-memory
collective gives a rank whose peer died (csrc/shm_comm/shm_comm.cpp) and
exits 1, so its failure reaches the launcher first by construction, and
the launcher is already tearing the job down when rank 1 dies. Any other
rank waits to be stopped by the teardown (the default SIGTERM action).
"""
import os
import signal
import sys
import time
from pathlib import Path

rank = int(os.environ["RANK"])
pid_file = Path("rank1.pid")
if rank == 1:
    terminated = []
    signal.signal(signal.SIGTERM, lambda _s, _f: terminated.append(True))
    pid_file.write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not terminated and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
elif rank == 0:
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    peer = pid_file.read_text()
    print(f"RuntimeError: shm collective: rank 1 (pid {peer}) exited while rank 0 waited for it",
          file=sys.stderr, flush=True)
    sys.exit(1)
time.sleep(60)

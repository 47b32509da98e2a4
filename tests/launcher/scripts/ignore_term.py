"""Rank script: ignores SIGTERM and SIGINT, starts a child process, prints its pids, sleeps 60 s.

Only SIGKILL ends it, so it checks that teardown escalates, and the child
checks that a rank's whole process group goes with it.
"""
import os
import signal
import subprocess
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(f"ready pid={os.getpid()} child={child.pid}", flush=True)
time.sleep(60)

"""Rank script: starts a daemon (double fork + setsid) that keeps the rank's stdout and stderr open, then exits.

argv: EXIT_CODE [PIDFILE]. The daemon's pid is written to PIDFILE.rank<RANK> so the test can check it is gone.
"""
import os
import sys
import time

code = int(sys.argv[1])
pidfile = sys.argv[2] if len(sys.argv) > 2 else None
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        if pidfile:
            with open(f"{pidfile}.rank{os.environ['RANK']}", "w") as f:
                f.write(str(os.getpid()))
        print("daemon started", flush=True)
        time.sleep(120)  # holds the inherited stdout/stderr pipes all along
        os._exit(0)
    os._exit(0)
os.wait()
while pidfile and not os.path.exists(f"{pidfile}.rank{os.environ['RANK']}"):
    time.sleep(0.01)
if code:
    print(f"rank {os.environ['RANK']} fails with {code}", file=sys.stderr)
sys.exit(code)

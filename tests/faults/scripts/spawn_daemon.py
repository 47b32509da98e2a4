"""Rank script: starts a daemon (double fork + setsid) that keeps the rank's stdout and stderr open, then exits.

argv: EXIT_CODE [PIDFILE [LINGER_S]]. The daemon's pid is written to PIDFILE.rank<RANK> so the test can check
it is gone; the rank itself exits after LINGER_S seconds (default 0).
"""
import os
import sys
import time

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # appended by dsrun unless --no_local_rank
code = int(args[0])
pidfile = args[1] if len(args) > 1 else None
linger = float(args[2]) if len(args) > 2 else 0.0
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        if pidfile:  # written whole, then renamed: a reader never sees an empty file
            target = f"{pidfile}.rank{os.environ['RANK']}"
            with open(f"{target}.tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(f"{target}.tmp", target)
        print("daemon started", flush=True)
        time.sleep(120)  # holds the inherited stdout/stderr pipes all along
        os._exit(0)
    os._exit(0)
os.wait()
while pidfile and not os.path.exists(f"{pidfile}.rank{os.environ['RANK']}"):
    time.sleep(0.01)
time.sleep(linger)
if code:
    print(f"rank {os.environ['RANK']} fails with {code}", file=sys.stderr)
sys.exit(code)

"""Rank script: rank 1 raises a chained exception from a deep stack; the other ranks sleep 60 s."""
import os
import time


def level(n):
    if n == 0:
        try:
            {}["missing"]
        except KeyError as exc:
            raise ValueError("boom from rank 1") from exc
    level(n - 1)


if os.environ["RANK"] == "1":
    time.sleep(0.3)  # let rank 0 start sleeping first
    level(30)  # deeper than the 40-line stderr tail
print("ready", flush=True)
time.sleep(60)

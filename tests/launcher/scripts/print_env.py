"""Rank script: prints its rank environment and argv as one JSON line on stdout."""
import json
import os
import sys

NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "NODE_RANK", "GROUP_RANK",
         "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT", "DSRUN_JOB_ID", "PYTHONUNBUFFERED"]
print("ENV " + json.dumps({"env": {n: os.environ.get(n) for n in NAMES}, "argv": sys.argv[1:]}))
print(f"to stderr from rank {os.environ['RANK']}", file=sys.stderr)

"""Writes tests/checkpoint/format1/ckpt: a format-1 checkpoint (sha256 per
file), as dsrun wrote them before XXH3-128 checksums (format 2).

Run from a checkout of a dsrun that writes format 1 (commit 6431e22 made the
committed files), at the repository root:

    python tests/checkpoint/format1/make_fixture.py OUT_DIR

TinyGPT (tests/zero/models.py) at ZeRO stage 1, fp32, on 2 gloo ranks, after
2 AdamW steps; OUT_DIR/ckpt is the checkpoint and OUT_DIR/expected.safetensors
the full fp32 parameters ("param/<name>") and Adam states
("state/<name>/<key>") it holds, gathered from the engine at save time.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())

from tests.checkpoint.test_checkpoint import _engine, _full_state, _run  # noqa: E402
from tests.dist_helpers import run_ranks  # noqa: E402
from tests.zero.models import batches  # noqa: E402


def _save(out):
    from safetensors.torch import save_file

    engine = _engine(1, "fp32", {})
    _run(engine, batches(int(os.environ["RANK"]), 2, 2, 1))
    engine.save_checkpoint(os.path.join(out, "ckpt"), client_state={"epoch": 3})
    params, states = _full_state(engine)
    if int(os.environ["RANK"]) == 0:
        save_file({**{f"param/{n}": v.contiguous() for n, v in params.items()},
                   **{f"state/{k}": v.contiguous() for k, v in states.items()}},
                  os.path.join(out, "expected.safetensors"))


if __name__ == "__main__":
    run_ranks(_save, 2, os.path.abspath(sys.argv[1]), timeout=300)

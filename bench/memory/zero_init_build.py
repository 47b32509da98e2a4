"""What building a model under zero.Init costs: time and peak RSS per rank, against eager.

    .venv/bin/python bench/memory/zero_init_build.py                   # 85M GPT (12 x 768), 2 gloo ranks
    .venv/bin/python bench/memory/zero_init_build.py --layers 4 --width 256

Builds examples/gpt_model.py's GPT (vocab 256, seq 1024) from seed 0 on
each of 2 gloo ranks (1 torch thread each), eagerly and under
`dsrun.zero.Init()`, each in a fresh pair of processes. Prints per rank the
construction wall time (s) and peak RSS (a dsrun.runtime.memory.profile
phase: VmHWM after clear_refs, minus the RSS before the build, MiB), and the model's fp32 size. Under zero.Init the
model's own initialisation (apply(_init_weights), the scaled proj.weight
loop, the tied head) is kept bit for bit (see [Note: writes under
zero.Init] in dsrun/runtime/zero/init_writes.py); its price is the
collectives that gather and re-partition a parameter each time
initialisation code touches it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.dist_helpers import run_ranks  # noqa: E402

MiB = 1 << 20


def build(init: bool, layers: int, width: int) -> dict:
    """One rank: (seconds, peak MiB, model MiB) of building the GPT."""
    import torch

    import dsrun
    from dsrun.runtime.memory import profile as memory_profile
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt_model import GPT, GPTConfig

    dsrun.init_distributed()
    cfg = GPTConfig(vocab_size=256, seq_len=1024, n_layer=layers, n_head=max(1, width // 64), n_embd=width)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with memory_profile.phase("construction"), dsrun.zero.Init(enabled=init):
        model = GPT(cfg)
    seconds = time.perf_counter() - t0
    record = memory_profile.recorded_phases()["construction"]
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return {"s": seconds, "peak": (record["rss_peak"] - record["rss_start"]) / MiB, "model": 4 * numel / MiB}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    args = p.parse_args()
    print(f"{'build':<10} {'rank':>4} {'time s':>8} {'peak MiB':>9} {'model MiB':>10}")
    for init in (False, True):
        for rank, r in enumerate(run_ranks(build, 2, init, args.layers, args.width, timeout=600)):
            print(f"{'zero.Init' if init else 'eager':<10} {rank:>4} {r['s']:>8.2f} {r['peak']:>9.0f} {r['model']:>10.0f}")


if __name__ == "__main__":
    main()

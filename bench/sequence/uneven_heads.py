"""Ulysses with head counts the sequence-parallel size does not divide:
all-to-all bytes and step time of uneven splits (what DistributedAttention
does) and of padding to a multiple of P (the alternative), against P
dividing the heads, in the same run.

    .venv/bin/python bench/sequence/uneven_heads.py [--world 4] [--tokens 2048] [--head-dim 64] [--repeats 7]

One attention layer, DistributedAttention around causal
scaled_dot_product_attention, batch 1, fp32, on `--world` gloo ranks of
one torch thread each. A step is forward + backward of that layer (q, k,
v in, a random output gradient), timed on every rank after a barrier; the
step time is the slowest rank's. Configurations (h query heads, h_kv
key/value heads):

  even 8      h = 8 = 2P: P divides the heads, the baseline
  uneven 6    h = 6: ranks take 2, 2, 1, 1 heads (all_to_all_single with
              split sizes), what dsrun does
  padded 6    h = 6 padded with 2 zero heads to 8, the even exchange, the
              padding dropped after it: a rank skips attention on its
              padding heads and returns zeros for them
  even 4      h = 4 = P: the fewest heads with P dividing them
  gqa even 8/4, gqa uneven 6/3, gqa padded 6/3 (key/value heads padded
              to 4, so that query head i still uses key/value head i // 2)

bytes       all_to_all_single bytes of one step (forward and backward)
            counted by dsrun's comms logger, summed over the ranks (each
            rank's whole send buffer, the block it keeps included)
step ms     min / median / max over `--repeats` interleaved rounds (every
            configuration once per round, in order), one warm-up round
            first
ratio       bytes and median step against "even 8" ("gqa even 8/4" for
            the gqa rows)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name, query heads, key/value heads, padded to (query, key/value) or None, baseline
CONFIGS = [("even 8", 8, 8, None, "even 8"), ("uneven 6", 6, 6, None, "even 8"),
           ("padded 6", 6, 6, (8, 8), "even 8"), ("even 4", 4, 4, None, "even 8"),
           ("gqa even 8/4", 8, 4, None, "gqa even 8/4"), ("gqa uneven 6/3", 6, 3, None, "gqa even 8/4"),
           ("gqa padded 6/3", 6, 3, (8, 4), "gqa even 8/4")]


def _attention(real: int, padded: int, rank: int, group_heads: int):
    """Causal sdpa on [1, N, heads, d]; with padding, this rank's global
    query heads [rank * group_heads, +group_heads) at or above `real` are
    padding: not computed, zeros returned for them."""
    import torch
    import torch.nn.functional as F

    def sdpa(q, k, v):
        k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    def attend(q, k, v):
        keep = max(0, min(group_heads, real - rank * group_heads)) if padded else q.shape[2]
        if keep == q.shape[2]:
            return sdpa(q, k, v)
        repeat = q.shape[2] // k.shape[2]  # the real query heads come first and use the first key/value heads
        real_out = (sdpa(q[:, :, :keep], k[:, :, :-(-keep // repeat)], v[:, :, :-(-keep // repeat)]) if keep
                    else q[:, :, :0])  # no real head here: an empty slice keeps the output in the graph
        return torch.cat([real_out, q.new_zeros(*q.shape[:2], q.shape[2] - keep, v.shape[3])], dim=2)
    return attend


def _run(args: argparse.Namespace) -> dict[str, dict]:
    """On every rank: all configurations, interleaved; rank 0 returns
    {name: {"bytes": ..., "ms": [...]}}."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import dsrun
    from dsrun.runtime.comm import comms_logger
    from dsrun.sequence import DistributedAttention

    torch.set_num_threads(1)
    dsrun.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    n, d = args.tokens // world, args.head_dim
    layers, inputs = {}, {}
    for name, heads, kv_heads, pad, _ in CONFIGS:
        padded = pad[0] if pad else 0
        layers[name] = DistributedAttention(_attention(heads, padded, rank, (padded or heads) // world),
                                            dist.group.WORLD)
        g = torch.Generator().manual_seed(heads * 100 + kv_heads)
        inputs[name] = [torch.randn(1, n, h, d, generator=g) for h in (heads, kv_heads, kv_heads, heads)]

    def step(name: str) -> float:
        heads, kv_heads, pad = next((h, kv, p) for c, h, kv, p, _ in CONFIGS if c == name)
        q, k, v, grad = (t.clone().requires_grad_(i < 3) for i, t in enumerate(inputs[name]))
        dist.barrier()
        start = time.perf_counter()
        if pad:  # zero heads appended, the exchange of the padded tensors, the padding cut off the output
            qp, kp, vp = (F.pad(t, (0, 0, 0, p - t.shape[2])) for t, p in ((q, pad[0]), (k, pad[1]), (v, pad[1])))
            out = layers[name](qp, kp, vp)[:, :, :heads]
        else:
            out = layers[name](q, k, v)
        out.backward(grad)
        seconds = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank finishes the step
        return float(seconds)

    results = {name: {"ms": []} for name, *_ in CONFIGS}
    for name in results:  # warm-up round, and the bytes of one step
        comms_logger.reset()
        step(name)
        stats = comms_logger.snapshot().get("all_to_all_single")
        sent = torch.tensor([float(stats.bytes)])
        dist.all_reduce(sent)
        results[name]["bytes"] = int(sent)
    for _ in range(args.repeats):
        for name in results:
            results[name]["ms"].append(step(name) * 1e3)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="sequence-parallel ranks P (4: the head counts above)")
    p.add_argument("--tokens", type=int, default=2048, help="whole sequence length N")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    from tests.dist_helpers import run_ranks

    results = run_ranks(_run, args.world, args, timeout=3000)[0]
    print(f"P = {args.world}, N = {args.tokens}, head_dim {args.head_dim}, batch 1, fp32, gloo, "
          f"{args.repeats} rounds\n")
    print("| config | bytes/step | bytes ratio | step ms min / median / max | step ratio (median) |")
    print("|---|---|---|---|---|")
    for name, *_, baseline in CONFIGS:
        r, base = results[name], results[baseline]
        ms = r["ms"]
        print(f"| {name} | {r['bytes']:,} | {r['bytes'] / base['bytes']:.3f} | {min(ms):.1f} / "
              f"{statistics.median(ms):.1f} / {max(ms):.1f} | "
              f"{statistics.median(ms) / statistics.median(base['ms']):.3f} |")


if __name__ == "__main__":
    main()

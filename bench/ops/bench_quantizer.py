"""Compression kernels (dsrun.ops.quantizer) vs their PyTorch fallbacks, one run.

    .venv/bin/python bench/ops/bench_quantizer.py [--numel 16777216] [--threads 2] [--repeats 7]

For each operation, the PyTorch code of comm/quantized.py / comm/compressed.py
(the baseline, what runs when the op is not built) and the native kernel with
every instruction set this CPU has (forced by DSRUN_CPU_ISA), interleaved
round by round so that drift on a shared machine hits every case. Throughput
is GB/s of fp32 values in (quantize, pack, compress) or out (dequantize,
unpack): 4 bytes per element over the median/min/max time.

Operations (numel fp32 values, block 256 as ZeRO++'s qwZ):
  int8 quantize / dequantize   quantize_blockwise / dequantize_blockwise
  int4 quantize / dequantize   quantize_int4 / dequantize_int4 (qgZ)
  1-bit pack / unpack          pack_signs / unpack_signs
  1-bit compress               signs + error feedback of one chunked tensor
                               (compressed_all_reduce's worker step, after
                               the scales: _signs_and_error)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import table  # noqa: E402

from dsrun.ops import quantizer  # noqa: E402
from dsrun.ops.isa import ISA_NAMES  # noqa: E402
from dsrun.runtime.comm import compressed, quantized  # noqa: E402

BLOCK = 256


def operations(n: int) -> dict:
    """name -> (pytorch fallback, public function that takes the native path); each a no-argument callable."""
    x = torch.randn(n)
    q8, s8 = quantized._quantize_torch(x, BLOCK)
    q4, s4 = quantized._quantize_int4_torch(x, BLOCK)
    packed = compressed._pack_signs_torch(x)
    world = 2
    chunk = compressed.server_chunk_numel(n, world)
    real = [min(chunk, n - j * chunk) for j in range(world)]
    y = torch.zeros(world * chunk)
    y[:n] = x
    y = y.view(world, chunk)
    scales = compressed._chunk_scales(y, real)
    error = torch.empty(n)

    def compress_torch():
        saved = quantizer._cpu
        quantizer._cpu = lambda: None
        try:
            compressed._signs_and_error(y, real, scales, error)
        finally:
            quantizer._cpu = saved

    return {
        "int8 quantize": (lambda: quantized._quantize_torch(x, BLOCK), lambda: quantized.quantize_blockwise(x, BLOCK)),
        "int8 dequantize": (lambda: quantized._dequantize_torch(q8, s8, torch.float32),
                            lambda: quantized.dequantize_blockwise(q8, s8)),
        "int4 quantize": (lambda: quantized._quantize_int4_torch(x, BLOCK), lambda: quantized.quantize_int4(x, BLOCK)),
        "int4 dequantize": (lambda: quantized._dequantize_int4_torch(q4, s4, torch.float32),
                            lambda: quantized.dequantize_int4(q4, s4)),
        "1-bit pack": (lambda: compressed._pack_signs_torch(x), lambda: compressed.pack_signs(x)),
        "1-bit unpack": (lambda: compressed._unpack_signs_torch(packed), lambda: compressed.unpack_signs(packed)),
        "1-bit compress": (compress_torch, lambda: compressed._signs_and_error(y, real, scales, error)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert quantizer.native_available(), "the quantizer op did not build"
    os.environ.pop("DSRUN_CPU_ISA", None)
    isas = ISA_NAMES[: ISA_NAMES.index(quantizer.selected_isa()) + 1]
    gb = 4 * args.numel / 1e9
    for op, (fallback, native) in operations(args.numel).items():
        cases = {"pytorch": (None, fallback), **{f"native {isa}": (isa, native) for isa in isas}}
        for isa, fn in cases.values():  # warm up
            os.environ["DSRUN_CPU_ISA"] = isa or ISA_NAMES[0]
            fn()
        samples: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeats):
            for name, (isa, fn) in cases.items():
                os.environ["DSRUN_CPU_ISA"] = isa or ISA_NAMES[0]
                t0 = time.perf_counter()
                fn()
                samples[name].append(gb / (time.perf_counter() - t0))
        print(table(f"{op}, {args.numel / 2**20:.0f}Mi fp32 values, {args.threads} threads", list(samples.items()),
                    baseline="pytorch", unit="GB/s", higher_is_better=True))
        print()


if __name__ == "__main__":
    main()

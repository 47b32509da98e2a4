// Run-time dispatch of the compression kernels by cpuid, and the C entry
// points that dsrun/ops/quantizer.py calls through ctypes (which releases the GIL).
#include "quantizer/quantizer.h"

const dsrun_quant_kernels* dsrun_quant_kernels_scalar();
const dsrun_quant_kernels* dsrun_quant_kernels_avx2();
const dsrun_quant_kernels* dsrun_quant_kernels_avx512();

namespace {
// The kernels for `isa`, or null when this CPU does not support it.
const dsrun_quant_kernels* kernels(int isa) {
  if (isa < DSRUN_ISA_SCALAR || isa > dsrun_detect_isa()) return nullptr;
  if (isa == DSRUN_ISA_AVX512) return dsrun_quant_kernels_avx512();
  if (isa == DSRUN_ISA_AVX2) return dsrun_quant_kernels_avx2();
  return dsrun_quant_kernels_scalar();
}
}  // namespace

extern "C" int dsrun_quant_best_isa(void) { return dsrun_detect_isa(); }

extern "C" int dsrun_quantize(const void* x, int32_t dtype, int64_t n, int64_t block, int32_t bits, void* q,
                              float* scales, int32_t threads, int isa) {
  const dsrun_quant_kernels* k = kernels(isa);
  return k ? k->quantize(x, dtype, n, block, bits, q, scales, threads) : -1;
}

extern "C" int dsrun_dequantize(const void* q, const float* scales, int64_t block, int32_t bits, int64_t n,
                                int32_t dtype, void* out, int32_t threads, int isa) {
  const dsrun_quant_kernels* k = kernels(isa);
  return k ? k->dequantize(q, scales, block, bits, n, dtype, out, threads) : -1;
}

extern "C" int dsrun_sign_pack(const void* x, int32_t dtype, int64_t n, uint8_t* out, int32_t threads, int isa) {
  const dsrun_quant_kernels* k = kernels(isa);
  return k ? k->sign_pack(x, dtype, n, out, threads) : -1;
}

extern "C" int dsrun_sign_unpack(const uint8_t* packed, const float* scales, int64_t chunk, int64_t n,
                                 int32_t dtype, void* out, int32_t threads, int isa) {
  const dsrun_quant_kernels* k = kernels(isa);
  return k ? k->sign_unpack(packed, scales, chunk, n, dtype, out, threads) : -1;
}

extern "C" int dsrun_onebit_compress(const float* y, int64_t chunks, int64_t width, const int64_t* real,
                                     const float* scales, uint8_t* packed, float* error, int64_t n_error,
                                     int32_t threads, int isa) {
  const dsrun_quant_kernels* k = kernels(isa);
  return k ? k->onebit_compress(y, chunks, width, real, scales, packed, error, n_error, threads) : -1;
}

// C interface of the compression kernels (block quantization for ZeRO++,
// sign packing for the 1-bit optimizers). No torch header: see [Note: build
// time] in dsrun/ops/builder.py. dsrun/ops/quantizer.py calls these through
// ctypes and checks shapes, dtypes and devices first; the kernels trust them.
//
// Every kernel reproduces the PyTorch code it replaces bit for bit
// (dsrun/runtime/comm/quantized.py and compressed.py), non-finite inputs
// included; see [Note: quantizer arithmetic] in quant_impl.h.
#pragma once
#include <stdint.h>

#include "common/cpu_isa.h"

#ifdef __cplusplus
extern "C" {
#endif

// Best instruction set this CPU supports among those compiled in.
int dsrun_quant_best_isa(void);

// Symmetric block quantization of x (dtype f32/bf16/f16, n elements) in
// blocks of `block` elements; the last block is padded with zeros.
//   bits 8: q is int8 [blocks*block], one value per byte.
//   bits 4: q is uint8 [blocks*block/2] (block even), two values per byte,
//           see [Note: int4 layout] in quant_impl.h.
// scales: fp32 [blocks]. Returns 0, -1 for an ISA this CPU lacks, -2 for a
// bad dtype/bits/block.
int dsrun_quantize(const void* x, int32_t dtype, int64_t n, int64_t block, int32_t bits, void* q, float* scales,
                   int32_t num_threads, int isa);

// Inverse: the first n values (n <= blocks*block) as out_dtype (f32/bf16/f16),
// q[i] * scales[i / block] computed in fp32 and rounded to nearest even.
int dsrun_dequantize(const void* q, const float* scales, int64_t block, int32_t bits, int64_t n, int32_t out_dtype,
                     void* out, int32_t num_threads, int isa);

// Sign bits of x (dtype f32/bf16/f16, n a multiple of 8): bit set where
// x >= 0 (so -0.0 sets it, nan clears it), 8 per byte, the first element in
// the most significant bit (numpy.packbits order). out: uint8 [n/8].
int dsrun_sign_pack(const void* x, int32_t dtype, int64_t n, uint8_t* out, int32_t num_threads, int isa);

// out[i] = (bit i set ? +1 : -1) * scales[i / chunk] for i < n, computed in
// fp32 and stored as out_dtype; scales NULL means 1. chunk: a multiple of 8.
int dsrun_sign_unpack(const uint8_t* packed, const float* scales, int64_t chunk, int64_t n, int32_t out_dtype,
                      void* out, int32_t num_threads, int isa);

// The 1-bit compression of y (fp32 [chunks * width], width a multiple of 8,
// element j of row k real when j < real[k], padding already zero), given the
// rows' scales: packed (uint8 [chunks * width / 8]) = sign bits of y as
// dsrun_sign_pack, error[i] = y[i] - (+-1) * scales[row] on real elements and
// 0 on padding, written for flat indices i < n_error only.
int dsrun_onebit_compress(const float* y, int64_t chunks, int64_t width, const int64_t* real, const float* scales,
                          uint8_t* packed, float* error, int64_t n_error, int32_t num_threads, int isa);

// One instruction set's kernels (quant_scalar.cpp, quant_avx2.cpp, quant_avx512.cpp).
typedef struct {
  int (*quantize)(const void*, int32_t, int64_t, int64_t, int32_t, void*, float*, int32_t);
  int (*dequantize)(const void*, const float*, int64_t, int32_t, int64_t, int32_t, void*, int32_t);
  int (*sign_pack)(const void*, int32_t, int64_t, uint8_t*, int32_t);
  int (*sign_unpack)(const uint8_t*, const float*, int64_t, int64_t, int32_t, void*, int32_t);
  int (*onebit_compress)(const float*, int64_t, int64_t, const int64_t*, const float*, uint8_t*, float*, int64_t,
                         int32_t);
} dsrun_quant_kernels;

#ifdef __cplusplus
}
#endif

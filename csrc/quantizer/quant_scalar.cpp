// Portable build of the compression kernels (any CPU); the compiler may
// auto-vectorise it with the baseline instruction set only.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "quantizer/quantizer.h"

namespace {
#include "common/scalar_convert.h"

struct V {
  static constexpr int W = 1;
  using reg = float;
  using ireg = uint32_t;
  static reg set1(float x) { return x; }
  static reg load(const float* p) { return *p; }
  static reg load_bf16(const uint16_t* p) { return cvt_bf16_to_f32(*p); }
  static reg load_f16(const uint16_t* p) { return cvt_f16_to_f32(*p); }
  static void store(float* p, reg x) { *p = x; }
  static void store_bf16(uint16_t* p, reg x) { *p = cvt_f32_to_bf16(x); }
  static void store_f16(uint16_t* p, reg x) { *p = cvt_f32_to_f16(x); }
  static reg mul(reg a, reg b) { return a * b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg div(reg a, reg b) { return a / b; }
  static ireg izero() { return 0; }
  static ireg max_abs_bits(ireg acc, reg x);
  static uint32_t reduce_max(ireg acc) { return acc; }
  static reg quant(reg x, reg d, float qmax);
  static void store_i8(int8_t* p, reg x) { *p = static_cast<int8_t>(x); }
  static reg load_i8(const int8_t* p) { return static_cast<float>(*p); }
  static reg load_u4(const uint8_t* p) { return static_cast<float>((*p & 0xf) - 8); }  // unused (W == 1)
  static uint32_t ge0_mask(reg x) { return x >= 0.0f; }
  static reg pm1(uint32_t bits);
};

#include "quantizer/quant_impl.h"

V::ireg V::max_abs_bits(ireg acc, reg x) {
  const uint32_t a = abs_bits(x);
  return a > acc ? a : acc;
}
V::reg V::quant(reg x, reg d, float qmax) { return quant1(x, d, qmax); }
V::reg V::pm1(uint32_t bits) { return kPm1[bits & 1u]; }
}  // namespace

const dsrun_quant_kernels* dsrun_quant_kernels_scalar() { return &kKernels; }

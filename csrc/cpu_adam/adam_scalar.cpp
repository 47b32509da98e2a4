// Portable build of the Adam kernel (any CPU); the compiler may auto-vectorise
// it with the baseline instruction set only.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_adam.h"

namespace {
#include "common/scalar_convert.h"

struct V {
  static constexpr int W = 1;
  static constexpr int ACC = 1;
  using reg = float;
  static reg set1(float x) { return x; }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg div(reg a, reg b) { return a / b; }
  static reg fmadd(reg a, reg b, reg c) { return a * b + c; }
  static reg sqrt(reg a) { return sqrtf(a); }
  static float sqrt1(float a) { return sqrtf(a); }
  static reg load(const float* p) { return *p; }
  static void store(float* p, reg x) { *p = x; }
  static reg load_bf16(const uint16_t* p) { return cvt_bf16_to_f32(*p); }
  static reg load_f16(const uint16_t* p) { return cvt_f16_to_f32(*p); }
  static void stream_bf16(uint16_t* p, reg x) { *p = cvt_f32_to_bf16(x); }
  static void stream_f16(uint16_t* p, reg x) { *p = cvt_f32_to_f16(x); }
  static void fence() {}
  static float bf16_to_f32(uint16_t h) { return cvt_bf16_to_f32(h); }
  static float f16_to_f32(uint16_t h) { return cvt_f16_to_f32(h); }
  static uint16_t f32_to_bf16(float f) { return cvt_f32_to_bf16(f); }
  static uint16_t f32_to_f16(float f) { return cvt_f32_to_f16(f); }
  static void sq_accumulate(reg x, double* acc) { acc[0] += static_cast<double>(x) * x; }
};

#include "adam_impl.h"
}  // namespace

int dsrun_adam_step_scalar(const dsrun_adam_args* a) { return adam_entry(a); }
int dsrun_sq_norm_scalar(const void* x, int32_t dtype, int64_t n, int32_t t, double* out) {
  return sq_norm_entry(x, dtype, n, t, out);
}

// AVX2 + FMA + F16C build of the Adam kernel. The instruction set is enabled
// for this file only (pragma below, after every system header), and the
// dispatcher calls it only when cpuid reports AVX2, FMA and F16C, so the
// library still loads and runs on older CPUs (no -march=native).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_adam.h"

#pragma GCC target("avx2,fma,f16c")

namespace {
#include "common/scalar_convert.h"
#include "common/bf16_avx2.h"

struct V {
  static constexpr int W = 8;
  static constexpr int ACC = 4;
  using reg = __m256;
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg sqrt(reg a) { return _mm256_sqrt_ps(a); }
  static float sqrt1(float a) { return sqrtf(a); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static reg load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void stream_bf16(uint16_t* p, reg x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), f32_to_bf16_bits(x));
  }
  static void stream_f16(uint16_t* p, reg x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void fence() { _mm_sfence(); }
  static float bf16_to_f32(uint16_t h) { return cvt_bf16_to_f32(h); }
  static float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t f32_to_bf16(float f) { return cvt_f32_to_bf16(f); }
  static uint16_t f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
  static void sq_accumulate(reg x, double* acc) {
    // fp64 accumulation: an fp32 sum of 1e8 squares loses the small terms.
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    __m256d s = _mm256_loadu_pd(acc);
    s = _mm256_fmadd_pd(lo, lo, s);
    s = _mm256_fmadd_pd(hi, hi, s);
    _mm256_storeu_pd(acc, s);
  }
};

#include "adam_impl.h"
}  // namespace

int dsrun_adam_step_avx2(const dsrun_adam_args* a) { return adam_entry(a); }
int dsrun_sq_norm_avx2(const void* x, int32_t dtype, int64_t n, int32_t t, double* out) {
  return sq_norm_entry(x, dtype, n, t, out);
}

// AVX-512F build of the Adam kernel, enabled for this file only and called only
// when cpuid reports AVX-512F (see adam_avx2.cpp for why not -march=native).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_adam.h"

#pragma GCC target("avx512f,avx2,fma,f16c")
// GCC 12 reports its own intrinsics headers (`__Y = __Y`) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {
#include "common/scalar_convert.h"
#include "common/bf16_avx512.h"

struct V {
  static constexpr int W = 16;
  static constexpr int ACC = 8;
  using reg = __m512;
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg sqrt(reg a) { return _mm512_sqrt_ps(a); }
  static float sqrt1(float a) { return sqrtf(a); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void stream_bf16(uint16_t* p, reg x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), f32_to_bf16_bits(x));
  }
  static void stream_f16(uint16_t* p, reg x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void fence() { _mm_sfence(); }
  static float bf16_to_f32(uint16_t h) { return cvt_bf16_to_f32(h); }
  static float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t f32_to_bf16(float f) { return cvt_f32_to_bf16(f); }
  static uint16_t f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
  static void sq_accumulate(reg x, double* acc) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    __m512d s = _mm512_loadu_pd(acc);
    s = _mm512_fmadd_pd(lo, lo, s);
    s = _mm512_fmadd_pd(hi, hi, s);
    _mm512_storeu_pd(acc, s);
  }
};

#include "adam_impl.h"
}  // namespace

int dsrun_adam_step_avx512(const dsrun_adam_args* a) { return adam_entry(a); }
int dsrun_sq_norm_avx512(const void* x, int32_t dtype, int64_t n, int32_t t, double* out) {
  return sq_norm_entry(x, dtype, n, t, out);
}

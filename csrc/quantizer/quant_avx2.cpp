// AVX2 + FMA + F16C build of the compression kernels, enabled for this file
// only and called only when cpuid reports them (see csrc/cpu_adam/adam_avx2.cpp).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "quantizer/quantizer.h"

#pragma GCC target("avx2,fma,f16c")

namespace {
#include "common/scalar_convert.h"
#include "common/bf16_avx2.h"

struct V {
  static constexpr int W = 8;
  using reg = __m256;
  using ireg = __m256i;
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static reg load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static void store_bf16(uint16_t* p, reg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f32_to_bf16_bits(x));
  }
  static void store_f16(uint16_t* p, reg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static ireg izero() { return _mm256_setzero_si256(); }
  static ireg max_abs_bits(ireg acc, reg x) {
    return _mm256_max_epu32(acc, _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)));
  }
  static uint32_t reduce_max(ireg acc) {
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
    uint32_t m = 0;
    for (uint32_t v : lanes) m = v > m ? v : m;
    return m;
  }
  static reg quant(reg x, reg d, float qmax) {
    __m256 r = _mm256_round_ps(_mm256_div_ps(x, d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // maxps/minps return their second operand when either is nan: r stays nan here ...
    r = _mm256_min_ps(_mm256_set1_ps(qmax), _mm256_max_ps(_mm256_set1_ps(-qmax), r));
    return _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));  // ... and becomes +0 here
  }
  static void store_i8(int8_t* p, reg x) {
    const __m256i i = _mm256_cvtps_epi32(x);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  static reg load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static reg load_u4(const uint8_t* p) {
    int32_t four;
    memcpy(&four, p, 4);
    const __m128i b = _mm_cvtsi32_si128(four);
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
    const __m256i q = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));  // low nibble first
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8)));
  }
  static uint32_t ge0_mask(reg x) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ)));
  }
  static reg pm1(uint32_t bits) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bit),
                                           lane_bit);
    return _mm256_blendv_ps(_mm256_set1_ps(-1.0f), _mm256_set1_ps(1.0f), _mm256_castsi256_ps(set));
  }
};

#include "quantizer/quant_impl.h"
}  // namespace

const dsrun_quant_kernels* dsrun_quant_kernels_avx2() { return &kKernels; }

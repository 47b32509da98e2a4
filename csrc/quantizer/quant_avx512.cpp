// AVX-512F build of the compression kernels, enabled for this file only and
// called only when cpuid reports AVX-512F (see csrc/cpu_adam/adam_avx2.cpp).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "quantizer/quantizer.h"

#pragma GCC target("avx512f,avx2,fma,f16c")
// GCC 12 reports its own intrinsics headers (`__Y = __Y`) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {
#include "common/scalar_convert.h"
#include "common/bf16_avx512.h"

struct V {
  static constexpr int W = 16;
  using reg = __m512;
  using ireg = __m512i;
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static void store_bf16(uint16_t* p, reg x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32_to_bf16_bits(x));
  }
  static void store_f16(uint16_t* p, reg x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static ireg izero() { return _mm512_setzero_si512(); }
  static ireg max_abs_bits(ireg acc, reg x) {
    return _mm512_max_epu32(acc, _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
  }
  static uint32_t reduce_max(ireg acc) { return _mm512_reduce_max_epu32(acc); }
  static reg quant(reg x, reg d, float qmax) {
    __m512 r = _mm512_roundscale_ps(_mm512_div_ps(x, d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // maxps/minps return their second operand when either is nan: r stays nan here ...
    r = _mm512_min_ps(_mm512_set1_ps(qmax), _mm512_max_ps(_mm512_set1_ps(-qmax), r));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r);  // ... and becomes +0 here
  }
  static void store_i8(int8_t* p, reg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(x)));
  }
  static reg load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static reg load_u4(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));  // low nibble first
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(8)));
  }
  static uint32_t ge0_mask(reg x) { return _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ); }
  static reg pm1(uint32_t bits) {
    return _mm512_mask_blend_ps(static_cast<__mmask16>(bits), _mm512_set1_ps(-1.0f), _mm512_set1_ps(1.0f));
  }
};

#include "quantizer/quant_impl.h"
}  // namespace

const dsrun_quant_kernels* dsrun_quant_kernels_avx512() { return &kKernels; }

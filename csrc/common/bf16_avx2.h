// fp32 -> bf16 bit patterns for a whole vector register, round to nearest
// even, nan -> quiet nan 0x7fc0: the vector form of cvt_f32_to_bf16 in
// scalar_convert.h, bit for bit. Included inside an instruction-set file's
// anonymous namespace after its `#pragma GCC target(...)`; the caller stores
// the result (plainly or with a streaming store).

// 8 fp32 lanes -> 8 bf16 values in a 128-bit register.
static inline __m128i f32_to_bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), is_nan);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

// fp32 -> bf16 bit patterns for a whole vector register, round to nearest
// even, nan -> quiet nan 0x7fc0: the vector form of cvt_f32_to_bf16 in
// scalar_convert.h, bit for bit. Included inside an instruction-set file's
// anonymous namespace after its `#pragma GCC target(...)`; the caller stores
// the result (plainly or with a streaming store).

// 16 fp32 lanes -> 16 bf16 values in a 256-bit register.
static inline __m256i f32_to_bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

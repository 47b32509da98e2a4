// Scalar conversions between fp32 and the 16-bit formats. Included inside each
// instruction-set file's anonymous namespace (internal linkage, see csrc/cpu_adam/adam_impl.h).
// Rounding is round-to-nearest-even, as torch's .to(torch.bfloat16/float16).

static inline float cvt_bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t cvt_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // nan stays a quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

static inline float cvt_f16_to_f32(uint16_t h) {
  _Float16 x;
  memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

static inline uint16_t cvt_f32_to_f16(float f) {
  const _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  memcpy(&h, &x, 2);
  return h;
}

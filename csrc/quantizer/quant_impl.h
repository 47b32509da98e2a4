// Compression kernels, written once against a small SIMD interface `V` and
// compiled once per instruction set (quant_scalar.cpp, quant_avx2.cpp,
// quant_avx512.cpp), each inside its own anonymous namespace (see
// csrc/cpu_adam/adam_impl.h for why nothing may be shared between them).
//
// Required from V:
//   W: lanes; reg: fp32 register; ireg: int32 register
//   set1, load(const float*), load_bf16/load_f16(const uint16_t*),
//   store(float*), store_bf16/store_f16(uint16_t*): unaligned
//   mul, sub, div
//   izero(), max_abs_bits(ireg, reg): lane-wise max of the bit patterns of |x|;
//     reduce_max(ireg) -> uint32_t
//   quant(reg x, reg d, float qmax): round-half-even(x / d) clamped to
//     [-qmax, qmax], nan -> 0
//   store_i8(int8_t*, reg): W integral values in [-127, 127] as int8
//   load_i8(const int8_t*) -> reg
//   load_u4(const uint8_t* p) -> reg: the W nibbles of p[0 .. W/2) minus 8,
//     low nibble first (unused when W == 1)
//   ge0_mask(reg) -> uint32_t: bit l set where lane l >= 0 (nan: clear)
//   pm1(uint32_t bits) -> reg: +1 where bit l is set, -1 elsewhere
//
// [Note: quantizer arithmetic] What the PyTorch code computes, and so what
// every kernel here computes, step for step (bit-identical results):
//   quantize: amax = max|x| over the block (if any element is nan: the quiet
//     nan 0x7fc00000, whatever nan it met, as torch.amax);
//     s = amax / qmax (fp32 division); s > 0 is false for 0 and nan, and
//     such a block is all zeros (its scale 0 or nan); otherwise
//     q = clamp(round_half_even(x / max(s, 1e-38)), -qmax, qmax), and a nan
//     quotient (an infinite element when s is infinite) becomes 0, which is
//     what torch's float -> int8 conversion gives on x86. Padding: q = 0.
//   dequantize: fp32 q * s, then rounded to nearest even to bf16/fp16.
//   signs: bit = (x >= 0); the +-1 value is multiplied by the scale (not
//     negated: -1 * nan keeps the nan's sign bit, as torch's mul); the
//     error is y - (+-1 * s).
// Values compare bit for bit; a nan is a nan (its payload may differ from
// torch's, whose own payload depends on which of its loops ran).

// Elements per OpenMP work item: large enough to amortise scheduling, small
// enough that a work item's second pass finds its data in L2.
constexpr int64_t kItem = 1 << 16;

struct RevTable {
  uint8_t v[256];
  constexpr RevTable() : v() {
    for (int b = 0; b < 256; ++b) {
      int r = 0;
      for (int k = 0; k < 8; ++k) r |= ((b >> k) & 1) << (7 - k);
      v[b] = static_cast<uint8_t>(r);
    }
  }
};
// kRev[b]: b with its bit order reversed (lane order <-> most significant first).
constexpr RevTable kRev;

inline uint32_t abs_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u & 0x7fffffffu;
}

inline float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

template <int T>
inline float load1(const void* x, int64_t i) {
  if (T == DSRUN_F32) return static_cast<const float*>(x)[i];
  if (T == DSRUN_BF16) return cvt_bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
  return cvt_f16_to_f32(static_cast<const uint16_t*>(x)[i]);
}

template <int T>
inline void store1(void* out, int64_t i, float v) {
  if (T == DSRUN_F32) static_cast<float*>(out)[i] = v;
  if (T == DSRUN_BF16) static_cast<uint16_t*>(out)[i] = cvt_f32_to_bf16(v);
  if (T == DSRUN_F16) static_cast<uint16_t*>(out)[i] = cvt_f32_to_f16(v);
}

template <int T>
inline typename V::reg loadv(const void* x, int64_t i) {
  if (T == DSRUN_F32) return V::load(static_cast<const float*>(x) + i);
  if (T == DSRUN_BF16) return V::load_bf16(static_cast<const uint16_t*>(x) + i);
  return V::load_f16(static_cast<const uint16_t*>(x) + i);
}

template <int T>
inline void storev(void* out, int64_t i, typename V::reg v) {
  if (T == DSRUN_F32) V::store(static_cast<float*>(out) + i, v);
  if (T == DSRUN_BF16) V::store_bf16(static_cast<uint16_t*>(out) + i, v);
  if (T == DSRUN_F16) V::store_f16(static_cast<uint16_t*>(out) + i, v);
}

inline float quant1(float x, float d, float qmax) {
  float r = nearbyintf(x / d);  // the default rounding mode: half to even
  if (r != r) return 0.0f;
  return r < -qmax ? -qmax : (r > qmax ? qmax : r);
}

// Run body(begin, end) over [0, n) in work items of `item` elements on `threads` threads.
template <typename F>
void parallel_items(int64_t n, int64_t item, int32_t threads, F body) {
  const int64_t items = (n + item - 1) / item;
  const int t = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(t) if (items > 1)
  for (int64_t c = 0; c < items; ++c) body(c * item, c * item + item < n ? c * item + item : n);
}

// ---- block quantization ----------------------------------------------------

// Largest |x| of block elements [b0, b0 + m) as the bit pattern of a float:
// bit patterns of non-negative floats order as the floats do, and every nan
// pattern lies above infinity's (0x7f800000), so the maximum is nan if any
// element is, and >= 0x7f800000 if any is not finite.
template <int T>
uint32_t block_amax_bits(const void* x, int64_t b0, int64_t m) {
  int64_t j = 0;
  uint32_t amax = 0;
  if (V::W > 1) {
    typename V::ireg acc = V::izero();
    for (; j + V::W <= m; j += V::W) acc = V::max_abs_bits(acc, loadv<T>(x, b0 + j));
    amax = V::reduce_max(acc);
  }
  for (; j < m; ++j) {
    const uint32_t a = abs_bits(load1<T>(x, b0 + j));
    amax = a > amax ? a : amax;
  }
  return amax;
}

// torch's amax gives this nan whatever the nan it met; a scale travels as bytes, so it must be the same.
constexpr uint32_t kQuietNan = 0x7fc00000u;

// int8 (comm/quantized.py quantize_blockwise): s = amax / 127, the quiet nan if any
// element is nan, inf if any is inf (then finite elements give q = 0 and
// infinite ones a nan quotient, which becomes 0); divisor max(s, 1e-38).
template <int T>
void quantize8_blocks(const void* x, int64_t n, int64_t block, int64_t blk0, int64_t blk1, int8_t* q,
                      float* scales) {
  constexpr float qmax = 127.0f;
  for (int64_t b = blk0; b < blk1; ++b) {
    const int64_t b0 = b * block;
    const int64_t m = n - b0 < block ? n - b0 : block;  // real elements of this block
    const uint32_t amax = block_amax_bits<T>(x, b0, m);
    const float s = amax > 0x7f800000u ? from_bits(kQuietNan) : from_bits(amax) / qmax;
    scales[b] = s;
    int8_t* qb = q + b0;
    if (!(s > 0.0f)) {
      memset(qb, 0, block);
      continue;
    }
    const float d = s < 1e-38f ? 1e-38f : s;
    const typename V::reg dv = V::set1(d);
    int64_t j = 0;
    for (; j + V::W <= m; j += V::W) V::store_i8(qb + j, V::quant(loadv<T>(x, b0 + j), dv, qmax));
    for (; j < m; ++j) qb[j] = static_cast<int8_t>(quant1(load1<T>(x, b0 + j), d, qmax));
    memset(qb + m, 0, block - m);
  }
}

// int4 ([Note: int4 layout] in comm/quantized.py quantize_int4): s = amax / 7,
// nan for a block holding any inf or nan; a block whose s is nan or 0 is all
// code 8 (q = 0); otherwise q = clamp(round_half_even(x / s), -7, 7) (no
// 1e-38 floor), stored as q + 8, element 2i in the low nibble of byte i.
template <int T>
void quantize4_blocks(const void* x, int64_t n, int64_t block, int64_t blk0, int64_t blk1, uint8_t* codes,
                      float* scales) {
  constexpr float qmax = 7.0f;
  for (int64_t b = blk0; b < blk1; ++b) {
    const int64_t b0 = b * block;
    const int64_t m = n - b0 < block ? n - b0 : block;
    const uint32_t amax = block_amax_bits<T>(x, b0, m);
    const float s = amax >= 0x7f800000u ? from_bits(kQuietNan) : from_bits(amax) / qmax;
    scales[b] = s;
    uint8_t* cb = codes + b0 / 2;
    if (!(s > 0.0f)) {
      memset(cb, 0x88, block / 2);
      continue;
    }
    const typename V::reg sv = V::set1(s);
    int64_t j = 0;
    if (V::W > 1) {
      for (; j + V::W <= m; j += V::W) {
        int8_t q[V::W];
        V::store_i8(q, V::quant(loadv<T>(x, b0 + j), sv, qmax));
        for (int p = 0; p + 1 < V::W; p += 2)
          cb[(j + p) / 2] = static_cast<uint8_t>((q[p] + 8) | ((q[p + 1] + 8) << 4));
      }
    }
    for (; j < m; ++j) {  // an even j starts a byte (its high nibble code 8 until the next element)
      const int c = static_cast<int>(quant1(load1<T>(x, b0 + j), s, qmax)) + 8;
      cb[j / 2] = (j & 1) ? static_cast<uint8_t>((cb[j / 2] & 0x0f) | (c << 4)) : static_cast<uint8_t>(c | 0x80);
    }
    if (m & 1) ++j;  // the padding element of a half-filled byte is already code 8
    memset(cb + j / 2, 0x88, (block - j) / 2);
  }
}

template <int T>
void quantize_all(const void* x, int64_t n, int64_t block, int32_t bits, void* q, float* scales, int32_t threads) {
  const int64_t blocks = (n + block - 1) / block;
  const int64_t per_item = block >= kItem ? 1 : kItem / block;
  parallel_items(blocks, per_item, threads, [&](int64_t b0, int64_t b1) {
    if (bits == 8) quantize8_blocks<T>(x, n, block, b0, b1, static_cast<int8_t*>(q), scales);
    else quantize4_blocks<T>(x, n, block, b0, b1, static_cast<uint8_t*>(q), scales);
  });
}

// Values [b0, e) of block `blk`: q * s in fp32, stored as T.
template <int T, int BITS>
void dequantize_range(const void* q, float s, int64_t b0, int64_t e, void* out) {
  const typename V::reg sv = V::set1(s);
  int64_t i = b0;
  if (BITS == 8) {
    const int8_t* q8 = static_cast<const int8_t*>(q);
    for (; i + V::W <= e; i += V::W) storev<T>(out, i, V::mul(V::load_i8(q8 + i), sv));
    for (; i < e; ++i) store1<T>(out, i, static_cast<float>(q8[i]) * s);
  } else {
    const uint8_t* c = static_cast<const uint8_t*>(q);
    if (V::W > 1)
      for (; i + V::W <= e; i += V::W) storev<T>(out, i, V::mul(V::load_u4(c + i / 2), sv));
    for (; i < e; ++i) store1<T>(out, i, static_cast<float>(((c[i / 2] >> (4 * (i & 1))) & 0xf) - 8) * s);
  }
}

template <int T>
void dequantize_all(const void* q, const float* scales, int64_t block, int32_t bits, int64_t n, void* out,
                    int32_t threads) {
  const int64_t blocks = (n + block - 1) / block;
  const int64_t per_item = block >= kItem ? 1 : kItem / block;
  parallel_items(blocks, per_item, threads, [&](int64_t blk0, int64_t blk1) {
    for (int64_t b = blk0; b < blk1; ++b) {
      const int64_t b0 = b * block, e = n - b0 < block ? n : b0 + block;
      if (bits == 8) dequantize_range<T, 8>(q, scales[b], b0, e, out);
      else dequantize_range<T, 4>(q, scales[b], b0, e, out);
    }
  });
}

inline bool bad_format(int64_t block, int32_t bits, int64_t n) {
  return block < 1 || n < 0 || !(bits == 8 || (bits == 4 && block % 2 == 0));
}

int quantize_entry(const void* x, int32_t dtype, int64_t n, int64_t block, int32_t bits, void* q, float* scales,
                   int32_t threads) {
  if (bad_format(block, bits, n)) return -2;
  switch (dtype) {
    case DSRUN_F32: quantize_all<DSRUN_F32>(x, n, block, bits, q, scales, threads); return 0;
    case DSRUN_BF16: quantize_all<DSRUN_BF16>(x, n, block, bits, q, scales, threads); return 0;
    case DSRUN_F16: quantize_all<DSRUN_F16>(x, n, block, bits, q, scales, threads); return 0;
    default: return -2;
  }
}

int dequantize_entry(const void* q, const float* scales, int64_t block, int32_t bits, int64_t n, int32_t dtype,
                     void* out, int32_t threads) {
  if (bad_format(block, bits, n)) return -2;
  switch (dtype) {
    case DSRUN_F32: dequantize_all<DSRUN_F32>(q, scales, block, bits, n, out, threads); return 0;
    case DSRUN_BF16: dequantize_all<DSRUN_BF16>(q, scales, block, bits, n, out, threads); return 0;
    case DSRUN_F16: dequantize_all<DSRUN_F16>(q, scales, block, bits, n, out, threads); return 0;
    default: return -2;
  }
}

// ---- sign bits -------------------------------------------------------------

// Bytes [byte0, byte1) of the packed signs of x.
template <int T>
void pack_bytes(const void* x, int64_t byte0, int64_t byte1, uint8_t* out) {
  int64_t b = byte0;
  if (V::W >= 8) {
    constexpr int per = V::W >= 8 ? V::W / 8 : 1;
    for (; b + per <= byte1; b += per) {
      const uint32_t m = V::ge0_mask(loadv<T>(x, b * 8));
      for (int k = 0; k < per; ++k) out[b + k] = kRev.v[(m >> (8 * k)) & 0xffu];
    }
  }
  for (; b < byte1; ++b) {
    uint32_t v = 0;
    for (int k = 0; k < 8; ++k) v |= static_cast<uint32_t>(load1<T>(x, b * 8 + k) >= 0.0f) << (7 - k);
    out[b] = static_cast<uint8_t>(v);
  }
}

template <int T>
void sign_pack_all(const void* x, int64_t n, uint8_t* out, int32_t threads) {
  parallel_items(n / 8, kItem / 8, threads, [&](int64_t b0, int64_t b1) { pack_bytes<T>(x, b0, b1, out); });
}

// -1 and +1 by sign bit. Indexing a table, not `bit ? 1 : -1`: GCC turns
// `(bit ? 1 : -1) * s` into a branch between s and -s, which mispredicts on
// random signs (8x slower) and flips a nan's sign bit where torch's multiply keeps it.
constexpr float kPm1[2] = {-1.0f, 1.0f};

inline float pm1_1(const uint8_t* packed, int64_t i) { return kPm1[(packed[i >> 3] >> (7 - (i & 7))) & 1]; }

// Elements [begin, end) of the unpacked (and scaled) signs; begin is a multiple of 8.
template <int T>
void unpack_range(const uint8_t* packed, const float* scales, int64_t chunk, int64_t begin, int64_t end, void* out) {
  for (int64_t i = begin; i < end;) {
    const int64_t k = i / chunk;
    const int64_t seg_end = (k + 1) * chunk < end ? (k + 1) * chunk : end;
    const float s = scales ? scales[k] : 1.0f;
    const typename V::reg sv = V::set1(s);
    if (V::W >= 8) {
      constexpr int per = V::W >= 8 ? V::W / 8 : 1;
      for (; i + V::W <= seg_end; i += V::W) {
        uint32_t m = 0;
        for (int b = 0; b < per; ++b) m |= static_cast<uint32_t>(kRev.v[packed[i / 8 + b]]) << (8 * b);
        storev<T>(out, i, V::mul(V::pm1(m), sv));
      }
    }
    for (; i < seg_end; ++i) store1<T>(out, i, pm1_1(packed, i) * s);
  }
}

int sign_pack_entry(const void* x, int32_t dtype, int64_t n, uint8_t* out, int32_t threads) {
  if (n < 0 || n % 8) return -2;
  switch (dtype) {
    case DSRUN_F32: sign_pack_all<DSRUN_F32>(x, n, out, threads); return 0;
    case DSRUN_BF16: sign_pack_all<DSRUN_BF16>(x, n, out, threads); return 0;
    case DSRUN_F16: sign_pack_all<DSRUN_F16>(x, n, out, threads); return 0;
    default: return -2;
  }
}

int sign_unpack_entry(const uint8_t* packed, const float* scales, int64_t chunk, int64_t n, int32_t dtype, void* out,
                      int32_t threads) {
  if (n < 0 || chunk < 8 || chunk % 8) return -2;
  auto run = [&](auto tag) {
    constexpr int T = decltype(tag)::value;
    parallel_items(n, kItem, threads, [&](int64_t b, int64_t e) { unpack_range<T>(packed, scales, chunk, b, e, out); });
  };
  switch (dtype) {
    case DSRUN_F32: run(std::integral_constant<int, DSRUN_F32>()); return 0;
    case DSRUN_BF16: run(std::integral_constant<int, DSRUN_BF16>()); return 0;
    case DSRUN_F16: run(std::integral_constant<int, DSRUN_F16>()); return 0;
    default: return -2;
  }
}

// ---- 1-bit compression with error feedback ---------------------------------

// Errors of elements [begin, end) of one row segment: y - (+-1) * s, or 0 on padding.
inline void error_segment(const float* y, int64_t begin, int64_t end, bool real, float s, float* error) {
  int64_t i = begin;
  if (!real) {
    memset(error + begin, 0, (end - begin) * sizeof(float));
    return;
  }
  const typename V::reg sv = V::set1(s);
  for (; i + V::W <= end; i += V::W) {
    const typename V::reg v = V::load(y + i);
    V::store(error + i, V::sub(v, V::mul(V::pm1(V::ge0_mask(v)), sv)));
  }
  for (; i < end; ++i) error[i] = y[i] - kPm1[y[i] >= 0.0f] * s;
}

int onebit_compress_entry(const float* y, int64_t chunks, int64_t width, const int64_t* real, const float* scales,
                          uint8_t* packed, float* error, int64_t n_error, int32_t threads) {
  if (chunks < 0 || width < 8 || width % 8) return -2;
  const int64_t n = chunks * width;
  parallel_items(n, kItem, threads, [&](int64_t begin, int64_t end) {
    pack_bytes<DSRUN_F32>(y, begin / 8, end / 8, packed);  // then the errors, from L2
    const int64_t limit = end < n_error ? end : n_error;
    for (int64_t i = begin; i < limit;) {
      const int64_t k = i / width;
      const int64_t real_end = k * width + real[k], row_end = (k + 1) * width;
      const bool is_real = i < real_end;
      int64_t seg_end = is_real ? real_end : row_end;
      seg_end = seg_end < limit ? seg_end : limit;
      error_segment(y, i, seg_end, is_real, scales[k], error);
      i = seg_end;
    }
  });
  return 0;
}

// This instruction set's entry points (exported by the including file).
const dsrun_quant_kernels kKernels = {quantize_entry, dequantize_entry, sign_pack_entry, sign_unpack_entry,
                                      onebit_compress_entry};

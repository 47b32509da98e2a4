// Adam kernel body, written once against a small SIMD interface `V` and
// compiled once per instruction set (adam_scalar.cpp, adam_avx2.cpp,
// adam_avx512.cpp). Each including file defines V and wraps this header in its
// own anonymous namespace, so no inline function is shared between files built
// for different instruction sets (the linker could otherwise keep the AVX-512
// copy of a function and run it on a CPU without AVX-512).
//
// Required from V:
//   W: lanes; reg: register type
//   set1(float), add, sub, mul, div, fmadd(a,b,c)=a*b+c, sqrt
//   load(const float*), store(float*, reg)
//   load_bf16(const uint16_t*), load_f16(const uint16_t*)
//   store_bf16(uint16_t*, reg), store_f16(uint16_t*, reg): unaligned stores;
//     stream_bf16 / stream_f16: non-temporal stores to a 2*W-byte aligned address
//   fence(): orders the non-temporal stores before the caller's next access
//   scalar twins: sqrt1, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16
//   sq_accumulate(reg x, double acc[ACC]) adds x*x into fp64 lanes.

// Elements per OpenMP work item: large enough to amortise scheduling,
// small enough to balance 2..64 threads on 1e5..1e9 elements.
constexpr int64_t kChunk = 1 << 16;

template <int GradT>
inline typename V::reg load_grad(const void* g, int64_t i) {
  if (GradT == DSRUN_F32) return V::load(static_cast<const float*>(g) + i);
  if (GradT == DSRUN_BF16) return V::load_bf16(static_cast<const uint16_t*>(g) + i);
  return V::load_f16(static_cast<const uint16_t*>(g) + i);
}

template <int GradT>
inline float load_grad1(const void* g, int64_t i) {
  if (GradT == DSRUN_F32) return static_cast<const float*>(g)[i];
  if (GradT == DSRUN_BF16) return V::bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  return V::f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

template <int CopyT>
inline void stream_copy(void* c, int64_t i, typename V::reg x) {
  if (CopyT == DSRUN_BF16) V::stream_bf16(static_cast<uint16_t*>(c) + i, x);
  if (CopyT == DSRUN_F16) V::stream_f16(static_cast<uint16_t*>(c) + i, x);
}

template <int CopyT>
inline void store_copy1(void* c, int64_t i, float x) {
  if (CopyT == DSRUN_BF16) static_cast<uint16_t*>(c)[i] = V::f32_to_bf16(x);
  if (CopyT == DSRUN_F16) static_cast<uint16_t*>(c)[i] = V::f32_to_f16(x);
}

// [Note: Adam arithmetic] The update follows torch.optim.Adam/AdamW:
//   g  = grad * grad_scale (+ wd * p for Adam's L2 form)
//   p *= 1 - lr * wd                          (AdamW only)
//   m  = m + (1 - b1) * (g - m)               (torch's lerp form)
//   v  = b2 * v + (1 - b2) * g * g
//   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
// Every element is read and written once: 16 bytes read and 12 written per
// fp32 parameter (plus 2 for a 16-bit copy), which is the memory-bandwidth
// floor of the step.
template <int GradT, int CopyT>
void adam_range(const dsrun_adam_args& a, int64_t begin, int64_t end) {
  using R = typename V::reg;
  const R one_minus_b1 = V::set1(1.0f - a.beta1);
  const R b2 = V::set1(a.beta2), one_minus_b2 = V::set1(1.0f - a.beta2);
  const R eps = V::set1(a.eps), gs = V::set1(a.grad_scale);
  const R neg_step = V::set1(-a.step_size), inv_bc2 = V::set1(1.0f / a.bc2_sqrt);
  const float decay = a.adamw_mode ? 1.0f - a.lr * a.weight_decay : 1.0f;
  const float l2 = a.adamw_mode ? 0.0f : a.weight_decay;
  const R decay_v = V::set1(decay), l2_v = V::set1(l2);
  int64_t i = begin;
  auto scalar_update = [&](int64_t j) {
    float p = a.param[j];
    float g = load_grad1<GradT>(a.grad, j) * a.grad_scale;
    if (l2 != 0.0f) g += l2 * p;
    p *= decay;
    float m = a.exp_avg[j], v = a.exp_avg_sq[j];
    m = (g - m) * (1.0f - a.beta1) + m;
    v = (g * g) * (1.0f - a.beta2) + v * a.beta2;
    p = -a.step_size * (m / (V::sqrt1(v) / a.bc2_sqrt + a.eps)) + p;
    a.exp_avg[j] = m;
    a.exp_avg_sq[j] = v;
    a.param[j] = p;
    store_copy1<CopyT>(a.param_copy, j, p);
  };
  // [Note: streaming the 16-bit copy] The copy is written, never read, in
  // this pass: a normal store first reads each cache line (read-for-ownership),
  // 2 extra bytes of traffic per parameter in a pass bound by memory
  // bandwidth. Non-temporal stores skip that read; they need an aligned
  // address, so a few leading elements go through the scalar path.
  if (CopyT != DSRUN_NONE) {
    constexpr uintptr_t kAlign = 2 * V::W;
    while (i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(a.param_copy) + i) % kAlign) != 0)
      scalar_update(i++);
  }
  for (; i + V::W <= end; i += V::W) {
    R p = V::load(a.param + i);
    R g = V::mul(load_grad<GradT>(a.grad, i), gs);
    if (l2 != 0.0f) g = V::fmadd(l2_v, p, g);  // skipped, not multiplied by 0: inf*0 is nan
    p = V::mul(p, decay_v);
    R m = V::load(a.exp_avg + i);
    R v = V::load(a.exp_avg_sq + i);
    m = V::fmadd(V::sub(g, m), one_minus_b1, m);
    v = V::fmadd(V::mul(g, g), one_minus_b2, V::mul(v, b2));
    R denom = V::add(V::mul(V::sqrt(v), inv_bc2), eps);
    p = V::fmadd(neg_step, V::div(m, denom), p);
    V::store(a.exp_avg + i, m);
    V::store(a.exp_avg_sq + i, v);
    V::store(a.param + i, p);
    stream_copy<CopyT>(a.param_copy, i, p);
  }
  for (; i < end; ++i) scalar_update(i);  // tail shorter than one vector
  if (CopyT != DSRUN_NONE) V::fence();
}

template <int GradT, int CopyT>
void adam_all(const dsrun_adam_args& a) {
  const int64_t chunks = (a.n + kChunk - 1) / kChunk;
  const int threads = a.num_threads > 0 ? a.num_threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * kChunk;
    const int64_t e = b + kChunk < a.n ? b + kChunk : a.n;
    adam_range<GradT, CopyT>(a, b, e);
  }
}

template <int GradT>
int adam_dispatch_copy(const dsrun_adam_args& a) {
  switch (a.copy_dtype) {
    case DSRUN_NONE: adam_all<GradT, DSRUN_NONE>(a); return 0;
    case DSRUN_BF16: adam_all<GradT, DSRUN_BF16>(a); return 0;
    case DSRUN_F16: adam_all<GradT, DSRUN_F16>(a); return 0;
    default: return -2;
  }
}

int adam_entry(const dsrun_adam_args* a) {
  switch (a->grad_dtype) {
    case DSRUN_F32: return adam_dispatch_copy<DSRUN_F32>(*a);
    case DSRUN_BF16: return adam_dispatch_copy<DSRUN_BF16>(*a);
    case DSRUN_F16: return adam_dispatch_copy<DSRUN_F16>(*a);
    default: return -2;
  }
}

template <int T>
double sq_norm_range(const void* x, int64_t begin, int64_t end) {
  double acc[V::ACC] = {0};
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W) V::sq_accumulate(load_grad<T>(x, i), acc);
  double s = 0;
  for (int k = 0; k < V::ACC; ++k) s += acc[k];
  for (; i < end; ++i) {
    const double v = load_grad1<T>(x, i);
    s += v * v;
  }
  return s;
}

template <int T>
double sq_norm_all(const void* x, int64_t n, int num_threads) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  double total = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * kChunk;
    total += sq_norm_range<T>(x, b, b + kChunk < n ? b + kChunk : n);
  }
  return total;
}

int sq_norm_entry(const void* x, int32_t dtype, int64_t n, int32_t threads, double* out) {
  switch (dtype) {
    case DSRUN_F32: *out = sq_norm_all<DSRUN_F32>(x, n, threads); return 0;
    case DSRUN_BF16: *out = sq_norm_all<DSRUN_BF16>(x, n, threads); return 0;
    case DSRUN_F16: *out = sq_norm_all<DSRUN_F16>(x, n, threads); return 0;
    default: return -2;
  }
}

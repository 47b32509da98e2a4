// Run-time dispatch of the CPU Adam kernels by cpuid, and the C entry points
// that dsrun/ops/adam.py calls through ctypes (ctypes releases the GIL).
#include "cpu_adam.h"

int dsrun_adam_step_scalar(const dsrun_adam_args*);
int dsrun_adam_step_avx2(const dsrun_adam_args*);
int dsrun_adam_step_avx512(const dsrun_adam_args*);
int dsrun_sq_norm_scalar(const void*, int32_t, int64_t, int32_t, double*);
int dsrun_sq_norm_avx2(const void*, int32_t, int64_t, int32_t, double*);
int dsrun_sq_norm_avx512(const void*, int32_t, int64_t, int32_t, double*);

extern "C" int dsrun_cpu_best_isa(void) { return dsrun_detect_isa(); }

extern "C" int dsrun_adam_step(const dsrun_adam_args* args, int isa) {
  if (isa < DSRUN_ISA_SCALAR || isa > dsrun_cpu_best_isa()) return -1;
  if (isa == DSRUN_ISA_AVX512) return dsrun_adam_step_avx512(args);
  if (isa == DSRUN_ISA_AVX2) return dsrun_adam_step_avx2(args);
  return dsrun_adam_step_scalar(args);
}

extern "C" int dsrun_sq_norm(const void* x, int32_t dtype, int64_t n, int32_t threads, int isa, double* out) {
  if (isa < DSRUN_ISA_SCALAR || isa > dsrun_cpu_best_isa()) return -1;
  if (isa == DSRUN_ISA_AVX512) return dsrun_sq_norm_avx512(x, dtype, n, threads, out);
  if (isa == DSRUN_ISA_AVX2) return dsrun_sq_norm_avx2(x, dtype, n, threads, out);
  return dsrun_sq_norm_scalar(x, dtype, n, threads, out);
}

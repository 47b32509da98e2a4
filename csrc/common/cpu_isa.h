// Element types and instruction sets shared by the CPU ops (cpu_adam,
// quantizer), and the cpuid check that picks the instruction set at run time.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Element types of tensors passed to the kernels.
enum dsrun_dtype { DSRUN_F32 = 0, DSRUN_BF16 = 1, DSRUN_F16 = 2, DSRUN_NONE = 3 };

// Instruction sets a kernel is compiled for; chosen at run time.
enum dsrun_isa { DSRUN_ISA_SCALAR = 0, DSRUN_ISA_AVX2 = 1, DSRUN_ISA_AVX512 = 2 };

#ifdef __cplusplus
}
#endif

// Best instruction set this CPU supports: AVX-512 needs AVX-512F only (the
// kernels use no BW/VL/DQ instruction), AVX2 needs FMA and F16C too.
static inline int dsrun_detect_isa(void) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return DSRUN_ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return DSRUN_ISA_AVX2;
#endif
  return DSRUN_ISA_SCALAR;
}

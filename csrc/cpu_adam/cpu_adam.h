// C interface of the CPU Adam op (no torch header: see [Note: build time] in
// dsrun/ops/builder.py). Python reaches these functions through ctypes.
#pragma once
#include <stdint.h>

#include "common/cpu_isa.h"  // dsrun_dtype (gradient, 16-bit copy), dsrun_isa

#ifdef __cplusplus
extern "C" {
#endif

// One Adam/AdamW step over a flat range of `n` elements.
// param, exp_avg, exp_avg_sq: fp32 [n], updated in place.
// grad: [n] of grad_dtype (f32, bf16 or f16), read only, multiplied by grad_scale
//   (1/loss_scale times the clipping coefficient) before use.
// param_copy: [n] of copy_dtype (bf16 or f16) written from the updated fp32
//   parameter in the same pass, or NULL with copy_dtype DSRUN_NONE.
// step_size = lr / (1 - beta1^t); bc2_sqrt = sqrt(1 - beta2^t) (computed by the caller).
typedef struct {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* param_copy;
  int64_t n;
  int32_t grad_dtype;
  int32_t copy_dtype;
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float step_size;
  float bc2_sqrt;
  float grad_scale;
  int32_t adamw_mode;   // 1: decoupled decay (AdamW); 0: L2 added to the gradient
  int32_t num_threads;  // OpenMP threads; <= 0 means OpenMP's default
} dsrun_adam_args;

// Best instruction set this CPU supports among those compiled in.
int dsrun_cpu_best_isa(void);

// Returns 0, or -1 if `isa` is not supported by this CPU, -2 for a bad dtype.
int dsrun_adam_step(const dsrun_adam_args* args, int isa);

// Sum of squares of x[0:n] (dtype f32/bf16/f16) accumulated in fp64; an inf or
// nan element makes the result inf or nan, which is how overflow is detected.
// Returns 0 and writes *out, or -1 / -2 as dsrun_adam_step.
int dsrun_sq_norm(const void* x, int32_t dtype, int64_t n, int32_t num_threads, int isa, double* out);

#ifdef __cplusplus
}
#endif

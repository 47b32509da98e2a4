// Fused multi-tensor Adam/AdamW for CUDA: one launch updates many tensors.
// No torch header (it compiles with plain nvcc, which CI checks on machines
// without a GPU or a CUDA build of torch); dsrun/ops/cuda_adam.py calls the C
// entry point through ctypes with raw device pointers and the current stream.
//
// Parameters and gradients are fp32, fp16 or bf16; the moments are fp32 and
// all arithmetic is fp32 (see [Note: Adam arithmetic] in
// csrc/cpu_adam/adam_impl.h for the update, which is the same here).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kMaxTensors = 36;   // per launch: the metadata is passed by value (4 KiB limit)
constexpr int kMaxBlocks = 320;
constexpr int kChunk = 2048 * 4;  // elements per block-chunk
constexpr int kThreads = 512;

struct Meta {
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  int64_t size[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];  // which tensor a block works on
  int block_chunk[kMaxBlocks];             // and which chunk of it
};

struct Hyper {
  float lr, beta1, beta2, eps, weight_decay, step_size, inv_bc2_sqrt, grad_scale;
  int adamw_mode;
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename P, typename G>
__global__ void adam_kernel(Meta meta, Hyper h, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // overflow: skip the step on device, no sync
  const int t = meta.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * kChunk;
  const int64_t n = meta.size[t];
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  P* p = static_cast<P*>(meta.param[t]);
  const G* g = static_cast<const G*>(meta.grad[t]);
  float* m = meta.exp_avg[t];
  float* v = meta.exp_avg_sq[t];
  const float decay = h.adamw_mode ? 1.0f - h.lr * h.weight_decay : 1.0f;
  const float l2 = h.adamw_mode ? 0.0f : h.weight_decay;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float pi = to_f(p[i]);
    float gi = to_f(g[i]) * h.grad_scale;
    if (l2 != 0.0f) gi = fmaf(l2, pi, gi);
    pi *= decay;
    float mi = fmaf(gi - m[i], 1.0f - h.beta1, m[i]);
    float vi = fmaf(gi * gi, 1.0f - h.beta2, v[i] * h.beta2);
    pi = fmaf(-h.step_size, mi / (sqrtf(vi) * h.inv_bc2_sqrt + h.eps), pi);
    m[i] = mi;
    v[i] = vi;
    p[i] = from_f<P>(pi);
  }
}

template <typename P, typename G>
cudaError_t launch_all(int n_tensors, void** params, const void** grads, float** exp_avgs, float** exp_avg_sqs,
                       const int64_t* sizes, const Hyper& h, const float* found_inf, cudaStream_t stream) {
  Meta meta;
  int tensors = 0, blocks = 0;
  for (int t = 0; t < n_tensors; ++t) {
    if (sizes[t] == 0) continue;
    meta.param[tensors] = params[t];
    meta.grad[tensors] = grads[t];
    meta.exp_avg[tensors] = exp_avgs[t];
    meta.exp_avg_sq[tensors] = exp_avg_sqs[t];
    meta.size[tensors] = sizes[t];
    const int64_t chunks = (sizes[t] + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_tensor[blocks] = static_cast<unsigned char>(tensors);
      meta.block_chunk[blocks] = static_cast<int>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      // Launch when the block table is full, or the tensor table is full at a tensor boundary.
      if (blocks == kMaxBlocks || (last_chunk && tensors + 1 == kMaxTensors)) {
        adam_kernel<P, G><<<blocks, kThreads, 0, stream>>>(meta, h, found_inf);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
        blocks = 0;
        if (!last_chunk) {  // the tensor continues in the next launch, as entry 0
          meta.param[0] = meta.param[tensors];
          meta.grad[0] = meta.grad[tensors];
          meta.exp_avg[0] = meta.exp_avg[tensors];
          meta.exp_avg_sq[0] = meta.exp_avg_sq[tensors];
          meta.size[0] = meta.size[tensors];
          tensors = 0;
        } else {
          tensors = -1;
        }
      }
    }
    ++tensors;
  }
  if (blocks > 0) {
    adam_kernel<P, G><<<blocks, kThreads, 0, stream>>>(meta, h, found_inf);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace

// dtype codes: 0 fp32, 1 bf16, 2 fp16 (as csrc/cpu_adam/cpu_adam.h).
// step_size = lr / (1 - beta1^t); bc2_sqrt = sqrt(1 - beta2^t); found_inf: a
// device float, non-zero skips the step (may be null). Returns a cudaError_t.
extern "C" int dsrun_cuda_multi_tensor_adam(int n_tensors, void** params, const void** grads, float** exp_avgs,
                                            float** exp_avg_sqs, const int64_t* sizes, int param_dtype,
                                            int grad_dtype, float lr, float beta1, float beta2, float eps,
                                            float weight_decay, float step_size, float bc2_sqrt, float grad_scale,
                                            int adamw_mode, const float* found_inf, void* stream) {
  const Hyper h{lr, beta1, beta2, eps, weight_decay, step_size, 1.0f / bc2_sqrt, grad_scale, adamw_mode};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (param_dtype != grad_dtype) return static_cast<int>(cudaErrorInvalidValue);
  switch (param_dtype) {
    case 0: return launch_all<float, float>(n_tensors, params, grads, exp_avgs, exp_avg_sqs, sizes, h, found_inf, s);
    case 1:
      return launch_all<__nv_bfloat16, __nv_bfloat16>(n_tensors, params, grads, exp_avgs, exp_avg_sqs, sizes, h,
                                                       found_inf, s);
    case 2: return launch_all<__half, __half>(n_tensors, params, grads, exp_avgs, exp_avg_sqs, sizes, h, found_inf, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

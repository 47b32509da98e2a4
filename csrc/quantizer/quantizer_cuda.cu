// CUDA build of the compression kernels (same C interface as quantizer.h,
// prefixed dsrun_cuda_, with the stream last instead of threads and ISA). No
// torch header: it compiles with plain nvcc (checked by the tests on machines
// without a GPU); dsrun/ops/quantizer.py passes raw device pointers and the
// current stream. The arithmetic is [Note: quantizer arithmetic] in
// quant_impl.h: IEEE division and rintf (round half to even), so the results
// match the CPU kernels and the PyTorch code bit for bit (nan payloads aside).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 256;
constexpr int kMaxGrid = 65535;

__device__ __forceinline__ float load_f(const void* x, int dtype, int64_t i) {
  if (dtype == 0) return static_cast<const float*>(x)[i];
  if (dtype == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]);
  return __half2float(static_cast<const __half*>(x)[i]);
}

__device__ __forceinline__ void store_f(void* out, int dtype, int64_t i, float v) {
  if (dtype == 0) static_cast<float*>(out)[i] = v;
  else if (dtype == 1) static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  else static_cast<__half*>(out)[i] = __float2half_rn(v);
}

__device__ __forceinline__ float quant1(float x, float d, float qmax) {
  const float r = rintf(__fdiv_rn(x, d));
  if (r != r) return 0.0f;
  return r < -qmax ? -qmax : (r > qmax ? qmax : r);
}

// Largest bit pattern of |x| over the block (see block_amax_bits in quant_impl.h), across the thread block.
__device__ uint32_t block_amax_bits(const void* x, int dtype, int64_t b0, int64_t m) {
  __shared__ uint32_t warp_max[kThreads / 32];
  uint32_t a = 0;
  for (int64_t j = threadIdx.x; j < m; j += blockDim.x) a = max(a, __float_as_uint(load_f(x, dtype, b0 + j)) & 0x7fffffffu);
  for (int o = 16; o > 0; o >>= 1) a = max(a, __shfl_xor_sync(0xffffffffu, a, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = a;
  __syncthreads();
  a = 0;
  for (int w = 0; w < kThreads / 32; ++w) a = max(a, warp_max[w]);
  __syncthreads();  // warp_max is reused by the next block of the grid-stride loop
  return a;
}

__global__ void quantize_kernel(const void* x, int dtype, int64_t n, int64_t block, int bits, void* q, float* scales) {
  const int64_t blocks = (n + block - 1) / block;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t b0 = b * block, m = n - b0 < block ? n - b0 : block;
    const uint32_t amax = block_amax_bits(x, dtype, b0, m);
    float s;
    if (bits == 8) s = amax > 0x7f800000u ? __uint_as_float(0x7fc00000u) : __fdiv_rn(__uint_as_float(amax), 127.0f);
    else s = amax >= 0x7f800000u ? __uint_as_float(0x7fc00000u) : __fdiv_rn(__uint_as_float(amax), 7.0f);
    if (threadIdx.x == 0) scales[b] = s;
    const bool usable = s > 0.0f;
    if (bits == 8) {
      const float d = s < 1e-38f ? 1e-38f : s;
      int8_t* qb = static_cast<int8_t*>(q) + b0;
      for (int64_t j = threadIdx.x; j < block; j += blockDim.x)
        qb[j] = (usable && j < m) ? static_cast<int8_t>(quant1(load_f(x, dtype, b0 + j), d, 127.0f)) : 0;
    } else {
      uint8_t* cb = static_cast<uint8_t*>(q) + b0 / 2;
      for (int64_t p = threadIdx.x; p < block / 2; p += blockDim.x) {
        int c[2];
        for (int h = 0; h < 2; ++h) {
          const int64_t j = 2 * p + h;
          c[h] = (usable && j < m ? static_cast<int>(quant1(load_f(x, dtype, b0 + j), s, 7.0f)) : 0) + 8;
        }
        cb[p] = static_cast<uint8_t>(c[0] | (c[1] << 4));
      }
    }
  }
}

__global__ void dequantize_kernel(const void* q, const float* scales, int64_t block, int bits, int64_t n, int dtype,
                                  void* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v;
    if (bits == 8) v = static_cast<float>(static_cast<const int8_t*>(q)[i]);
    else v = static_cast<float>(((static_cast<const uint8_t*>(q)[i / 2] >> (4 * (i & 1))) & 0xf) - 8);
    store_f(out, dtype, i, __fmul_rn(v, scales[i / block]));
  }
}

__device__ __forceinline__ uint8_t sign_byte(const void* x, int dtype, int64_t byte) {
  uint32_t v = 0;
  for (int k = 0; k < 8; ++k) v |= static_cast<uint32_t>(load_f(x, dtype, byte * 8 + k) >= 0.0f) << (7 - k);
  return static_cast<uint8_t>(v);
}

__global__ void sign_pack_kernel(const void* x, int dtype, int64_t bytes, uint8_t* out) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < bytes;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[b] = sign_byte(x, dtype, b);
}

__global__ void sign_unpack_kernel(const uint8_t* packed, const float* scales, int64_t chunk, int64_t n, int dtype,
                                   void* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float pm1 = (packed[i >> 3] >> (7 - (i & 7))) & 1 ? 1.0f : -1.0f;
    store_f(out, dtype, i, scales ? __fmul_rn(pm1, scales[i / chunk]) : pm1);
  }
}

__global__ void onebit_compress_kernel(const float* y, int64_t chunks, int64_t width, const int64_t* real,
                                       const float* scales, uint8_t* packed, float* error, int64_t n_error) {
  const int64_t bytes = chunks * width / 8;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < bytes;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    packed[b] = sign_byte(y, 0, b);
    const int64_t k = (b * 8) / width;  // width is a multiple of 8: a byte lies in one row
    const float s = scales[k];
    for (int e = 0; e < 8; ++e) {
      const int64_t i = b * 8 + e;
      if (i >= n_error) break;
      const float v = y[i];
      error[i] = i - k * width < real[k] ? __fsub_rn(v, __fmul_rn(v >= 0.0f ? 1.0f : -1.0f, s)) : 0.0f;
    }
  }
}

int grid_for(int64_t work) {
  const int64_t g = (work + kThreads - 1) / kThreads;
  return static_cast<int>(g < 1 ? 1 : (g > kMaxGrid ? kMaxGrid : g));
}

int done() { return static_cast<int>(cudaGetLastError()); }

bool bad_format(int64_t block, int32_t bits, int64_t n) {
  return block < 1 || n < 0 || !(bits == 8 || (bits == 4 && block % 2 == 0));
}

}  // namespace

// Return 0 or a cudaError_t (cudaErrorInvalidValue for arguments the CPU kernels reject with -2).
extern "C" int dsrun_cuda_quantize(const void* x, int32_t dtype, int64_t n, int64_t block, int32_t bits, void* q,
                                   float* scales, void* stream) {
  if (bad_format(block, bits, n) || dtype < 0 || dtype > 2) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t blocks = (n + block - 1) / block;
  if (blocks == 0) return 0;
  quantize_kernel<<<static_cast<int>(blocks < kMaxGrid ? blocks : kMaxGrid), kThreads, 0,
                    static_cast<cudaStream_t>(stream)>>>(x, dtype, n, block, bits, q, scales);
  return done();
}

extern "C" int dsrun_cuda_dequantize(const void* q, const float* scales, int64_t block, int32_t bits, int64_t n,
                                     int32_t dtype, void* out, void* stream) {
  if (bad_format(block, bits, n) || dtype < 0 || dtype > 2) return static_cast<int>(cudaErrorInvalidValue);
  if (n == 0) return 0;
  dequantize_kernel<<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(q, scales, block, bits, n,
                                                                                     dtype, out);
  return done();
}

extern "C" int dsrun_cuda_sign_pack(const void* x, int32_t dtype, int64_t n, uint8_t* out, void* stream) {
  if (n < 0 || n % 8 || dtype < 0 || dtype > 2) return static_cast<int>(cudaErrorInvalidValue);
  if (n == 0) return 0;
  sign_pack_kernel<<<grid_for(n / 8), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, dtype, n / 8, out);
  return done();
}

extern "C" int dsrun_cuda_sign_unpack(const uint8_t* packed, const float* scales, int64_t chunk, int64_t n,
                                      int32_t dtype, void* out, void* stream) {
  if (n < 0 || chunk < 8 || chunk % 8 || dtype < 0 || dtype > 2) return static_cast<int>(cudaErrorInvalidValue);
  if (n == 0) return 0;
  sign_unpack_kernel<<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(packed, scales, chunk, n,
                                                                                      dtype, out);
  return done();
}

extern "C" int dsrun_cuda_onebit_compress(const float* y, int64_t chunks, int64_t width, const int64_t* real,
                                          const float* scales, uint8_t* packed, float* error, int64_t n_error,
                                          void* stream) {
  if (chunks < 0 || width < 8 || width % 8) return static_cast<int>(cudaErrorInvalidValue);
  if (chunks == 0) return 0;
  onebit_compress_kernel<<<grid_for(chunks * width / 8), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      y, chunks, width, real, scales, packed, error, n_error);
  return done();
}

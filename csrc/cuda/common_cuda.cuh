// Shared pieces of the CUDA kernels: dtype dispatch, fp32 conversion and launch checking.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "../ops.h"

namespace osp {
namespace cuda {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// Round to T and back, where torch.optim materialises a tensor of dtype T.
template <typename T> __device__ __forceinline__ float rnd(float x) { return to_f(from_f<T>(x)); }

template <typename F> void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f(float{}); break;
    case DType::F16: f(__half{}); break;
    case DType::BF16: f(__nv_bfloat16{}); break;
  }
}

inline void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("osp: CUDA launch of ") + what + " failed: " +
                             cudaGetErrorString(e));
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

constexpr int kThreads = 256;
// Grid for a grid-stride loop over `work` items: enough CTAs to fill the GPU, capped.
inline unsigned grid_for(int64_t work, int64_t per_cta = kThreads) {
  const int64_t g = (work + per_cta - 1) / per_cta;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 * 8 ? 65535 * 8 : g));
}

__device__ __forceinline__ int64_t block_len(int64_t b, int64_t n, int64_t bs) {
  const int64_t r = n - b * bs;
  return r < bs ? r : bs;
}

}  // namespace cuda
}  // namespace osp

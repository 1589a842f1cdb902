// Shared pieces of the CUDA kernels: dtype dispatch, fp32 conversion, launch checking, and the fixed-order
// fold of a thread group (the launch shapes themselves are host arithmetic in ../launch.h).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "../launch.h"
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

using launch::block_len;
using launch::kThreads;

// Grid for a grid-stride loop over `work` elements (the elementwise optimizer steps): capped.
inline unsigned grid_for(int64_t work, int64_t per_cta = kThreads) {
  const int64_t g = launch::cdiv(work, per_cta);
  return static_cast<unsigned>(g < 1 ? 1 : (g > launch::kMaxGrid ? launch::kMaxGrid : g));
}

// Grid of a launch shape (at least one CTA: a kernel with no items returns at once).
inline unsigned grid_of(const launch::Shape& s) { return static_cast<unsigned>(s.grid < 1 ? 1 : s.grid); }

template <Metric M> __device__ __forceinline__ float fold(float a, float b) {
  if constexpr (M == Metric::Max) return a > b ? a : b;
  else return __fadd_rn(a, b);
}

// Folds v over each group of `group` consecutive threads (a power of two <= kThreads) in a fixed tree:
// shuffles within a warp, then the warps' results in index order. The result lands in the group's
// first thread. Every thread of the CTA must call it (it synchronises when group > 32); `part` holds
// kThreads / 32 floats of shared memory.
template <Metric M> __device__ __forceinline__ float group_fold(float v, int group, float* part) {
  const int width = group < 32 ? group : 32;
  for (int off = width >> 1; off > 0; off >>= 1) v = fold<M>(v, __shfl_down_sync(0xffffffffu, v, off, width));
  if (group <= 32) return v;
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's readers are done with part
  if ((threadIdx.x & 31) == 0) part[warp] = v;
  __syncthreads();
  if ((threadIdx.x & (group - 1)) == 0)
    for (int k = 1; k < group / 32; ++k) v = fold<M>(v, part[warp + k]);
  return v;
}

}  // namespace cuda
}  // namespace osp

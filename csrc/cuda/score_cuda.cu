// Block importance scores: one CTA per block (grid-stride over blocks), fixed-order reduction in
// shared memory so the same inputs give the same bits on every rank.
#include "common_cuda.cuh"

namespace osp {
namespace cuda {
namespace {

template <Metric M, typename T>
__global__ void score_blocks_kernel(const T* __restrict__ g, const T* __restrict__ w, int64_t n,
                                    int64_t bs, float eps, float* __restrict__ scores,
                                    int32_t* __restrict__ nonfinite) {
  __shared__ float red[kThreads];
  __shared__ float nfr[kThreads];
  const int64_t nb = (n + bs - 1) / bs;
  for (int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const int64_t off = b * bs, len = block_len(b, n, bs);
    float acc = 0.f, nf = 0.f;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const float x = to_f(g[off + i]);
      float t;
      if constexpr (M == Metric::L2) t = x * x;
      else if constexpr (M == Metric::Relative) t = fabsf(x) / (fabsf(to_f(w[off + i])) + eps);
      else t = fabsf(x);
      if constexpr (M == Metric::Max) acc = acc > t ? acc : t;
      else acc += t;
      nf += x * 0.f;  // nan exactly when x is inf or nan
    }
    red[threadIdx.x] = acc;
    nfr[threadIdx.x] = nf;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) {
        const float o = red[threadIdx.x + s];
        if constexpr (M == Metric::Max) red[threadIdx.x] = red[threadIdx.x] > o ? red[threadIdx.x] : o;
        else red[threadIdx.x] += o;
        nfr[threadIdx.x] += nfr[threadIdx.x + s];
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      scores[b] = red[0];
      if (nfr[0] != 0.f) atomicOr(nonfinite, 1);
    }
    __syncthreads();
  }
}

}  // namespace

void score_blocks(DType dt, const void* g, const void* w, int64_t n, int64_t bs, Metric m,
                  float eps, float* scores, int32_t* nonfinite, void* stream) {
  const int64_t nb = num_blocks(n, bs);
  if (nb == 0) return;
  const unsigned grid = grid_for(nb, 1);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto G = static_cast<const T*>(g);
    auto W = static_cast<const T*>(w);
    auto s = as_stream(stream);
    switch (m) {
      case Metric::L2: score_blocks_kernel<Metric::L2><<<grid, kThreads, 0, s>>>(G, W, n, bs, eps, scores, nonfinite); break;
      case Metric::L1: score_blocks_kernel<Metric::L1><<<grid, kThreads, 0, s>>>(G, W, n, bs, eps, scores, nonfinite); break;
      case Metric::Max: score_blocks_kernel<Metric::Max><<<grid, kThreads, 0, s>>>(G, W, n, bs, eps, scores, nonfinite); break;
      case Metric::Relative: score_blocks_kernel<Metric::Relative><<<grid, kThreads, 0, s>>>(G, W, n, bs, eps, scores, nonfinite); break;
    }
    check_launch("score_blocks_kernel");
  });
}

}  // namespace cuda
}  // namespace osp

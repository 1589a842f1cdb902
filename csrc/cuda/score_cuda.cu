// Block importance scores over the launch shape of ../launch.h: a grid over (block, chunk) items, so a
// single 400 MB block is spread over many CTAs and small blocks share one (a thread group per block).
// Each item folds its elements in a fixed tree (each thread in index order, then the group's shuffle
// tree); blocks of several chunks take a second pass that folds their partials, again in a fixed
// order. The order depends only on (n, bs), never on the GPU or the grid, so the same inputs give the
// same bits on every run and rank (sums may differ from the CPU's order in the last bits; max is
// exact). The non-finite flag is an OR over every element, whatever the order.
#include "common_cuda.cuh"

namespace osp {
namespace cuda {
namespace {

using launch::Item;
using launch::Shape;

// Pass 1: the metric's term of each element of block `row`, and whether g is finite there.
template <Metric M, typename T> struct BlockTerms {
  const T* __restrict__ g;
  const T* __restrict__ w;
  int64_t n, bs;
  float eps;
  __device__ __forceinline__ int64_t start(int64_t row) const { return row * bs; }
  __device__ __forceinline__ int64_t len(int64_t row) const { return block_len(row, n, bs); }
  __device__ __forceinline__ float operator()(int64_t j, bool& bad) const {
    const float x = to_f(g[j]);
    bad |= !isfinite(x);
    if constexpr (M == Metric::L2) return __fmul_rn(x, x);
    else if constexpr (M == Metric::Relative) return __fdiv_rn(fabsf(x), __fadd_rn(fabsf(to_f(w[j])), eps));
    else return fabsf(x);
  }
};

// Pass 2: the partials of block `row`, `per_row` of them, contiguous in the workspace.
struct Partials {
  const float* __restrict__ ws;
  int64_t per_row;
  __device__ __forceinline__ int64_t start(int64_t row) const { return row * per_row; }
  __device__ __forceinline__ int64_t len(int64_t) const { return per_row; }
  __device__ __forceinline__ float operator()(int64_t j, bool&) const { return ws[j]; }
};

// out[item] = fold of the item's terms (one chunk per row: out[row]). nonfinite may be null.
template <Metric M, class Src>
__global__ void __launch_bounds__(kThreads) score_kernel(const Shape s, const Src src, float* __restrict__ out,
                                                         int32_t* __restrict__ nonfinite) {
  __shared__ float part[kThreads / 32];
  const int slot = threadIdx.x / s.group, lane = threadIdx.x & (s.group - 1);
  bool bad = false;
  for (int64_t cta = blockIdx.x; cta < s.ctas; cta += gridDim.x) {
    const int64_t q = launch::item_index(s, cta, slot);
    float acc = 0.f;  // the identity of every fold: terms are >= 0 (or nan)
    if (q < s.items) {
      const Item it = launch::item_at(s, q);
      const int64_t off = src.start(it.row), hi = launch::item_end(s, it, src.len(it.row));
      for (int64_t i = it.lo + lane; i < hi; i += s.group) acc = fold<M>(acc, src(off + i, bad));
    }
    acc = group_fold<M>(acc, s.group, part);  // every thread of the CTA, active or not
    if (lane == 0 && q < s.items) out[q] = acc;
  }
  if (nonfinite != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) atomicOr(nonfinite, 1);
}

template <Metric M, typename T>
void score_launch(const launch::ScorePlan& p, const T* g, const T* w, int64_t n, int64_t bs, float eps,
                  float* scores, int32_t* nonfinite, float* workspace, cudaStream_t st) {
  const BlockTerms<M, T> terms{g, w, n, bs, eps};
  if (p.workspace == 0) {
    score_kernel<M><<<grid_of(p.pass1), kThreads, 0, st>>>(p.pass1, terms, scores, nonfinite);
    check_launch("score_kernel");
    return;
  }
  score_kernel<M><<<grid_of(p.pass1), kThreads, 0, st>>>(p.pass1, terms, workspace, nonfinite);
  check_launch("score_kernel (pass 1)");
  score_kernel<M><<<grid_of(p.pass2), kThreads, 0, st>>>(p.pass2, Partials{workspace, p.pass1.chunks}, scores,
                                                          static_cast<int32_t*>(nullptr));
  check_launch("score_kernel (pass 2)");
}

}  // namespace

int64_t score_workspace(int64_t n, int64_t bs) { return launch::score_plan(n, bs).workspace; }

void score_blocks(DType dt, const void* g, const void* w, int64_t n, int64_t bs, Metric m,
                  float eps, float* scores, int32_t* nonfinite, float* workspace, void* stream) {
  const launch::ScorePlan p = launch::score_plan(n, bs);
  if (p.pass1.items == 0) return;
  if (p.workspace > 0 && workspace == nullptr)
    throw std::runtime_error("osp: score_blocks needs a workspace of score_workspace(n, bs) floats");
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto G = static_cast<const T*>(g);
    auto W = static_cast<const T*>(w);
    auto s = as_stream(stream);
    switch (m) {
      case Metric::L2: score_launch<Metric::L2>(p, G, W, n, bs, eps, scores, nonfinite, workspace, s); break;
      case Metric::L1: score_launch<Metric::L1>(p, G, W, n, bs, eps, scores, nonfinite, workspace, s); break;
      case Metric::Max: score_launch<Metric::Max>(p, G, W, n, bs, eps, scores, nonfinite, workspace, s); break;
      case Metric::Relative:
        score_launch<Metric::Relative>(p, G, W, n, bs, eps, scores, nonfinite, workspace, s);
        break;
    }
  });
}

}  // namespace cuda
}  // namespace osp

// Block importance scores in one pass, with the non-finite check folded into the same loop.
#include "common_cpu.h"

namespace osp {
namespace cpu {
namespace {

constexpr int kLanes = 16;  // independent partial sums: lets the compiler vectorize without -ffast-math

template <Metric M, typename T>
OSP_HOT float score_block(const T* g, const T* w, int64_t len, float eps, float* nf_out) {
  float acc[kLanes] = {0.f};
  float nf[kLanes] = {0.f};  // x * 0 is nan exactly when x is inf or nan
  auto term = [&](int64_t i) -> float {
    float x = to_f(g[i]);
    if constexpr (M == Metric::L2) return x * x;
    else if constexpr (M == Metric::Relative) return std::fabs(x) / (std::fabs(to_f(w[i])) + eps);
    else return std::fabs(x);
  };
  auto fold = [](float a, float t) {
    if constexpr (M == Metric::Max) return a > t ? a : t;
    else return a + t;
  };
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      acc[j] = fold(acc[j], term(i + j));
      nf[j] += to_f(g[i + j]) * 0.f;
    }
  }
  float s = 0.f, z = 0.f;
  for (int j = 0; j < kLanes; ++j) { s = fold(s, acc[j]); z += nf[j]; }
  for (; i < len; ++i) { s = fold(s, term(i)); z += to_f(g[i]) * 0.f; }
  *nf_out = z;
  return s;
}

template <Metric M, typename T>
void score_all(const T* g, const T* w, int64_t n, int64_t bs, float eps, float* scores,
               int32_t* nonfinite) {
  const int64_t nb = num_blocks(n, bs);
  std::atomic<int32_t> bad{0};
  at::parallel_for(0, nb, block_grain(bs), [&](int64_t b0, int64_t b1) {
    bool local_bad = false;
    for (int64_t b = b0; b < b1; ++b) {
      float z;
      const int64_t off = b * bs;
      scores[b] = score_block<M>(g + off, M == Metric::Relative ? w + off : w, block_len(b, n, bs),
                                 eps, &z);
      local_bad |= (z != 0.f);  // nan != 0 is true
    }
    if (local_bad) bad.store(1, std::memory_order_relaxed);
  });
  if (bad.load()) *nonfinite = 1;
}

}  // namespace

void score_blocks(DType dt, const void* g, const void* w, int64_t n, int64_t bs, Metric m,
                  float eps, float* scores, int32_t* nonfinite) {
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto G = static_cast<const T*>(g);
    auto W = static_cast<const T*>(w);
    switch (m) {
      case Metric::L2: score_all<Metric::L2>(G, W, n, bs, eps, scores, nonfinite); break;
      case Metric::L1: score_all<Metric::L1>(G, W, n, bs, eps, scores, nonfinite); break;
      case Metric::Max: score_all<Metric::Max>(G, W, n, bs, eps, scores, nonfinite); break;
      case Metric::Relative: score_all<Metric::Relative>(G, W, n, bs, eps, scores, nonfinite); break;
    }
  });
}

}  // namespace cpu
}  // namespace osp

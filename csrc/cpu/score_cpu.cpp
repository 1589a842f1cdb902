// Block importance scores in one pass, with the non-finite check folded into the same loop.
#include "common_cpu.h"

namespace osp {
namespace cpu {
namespace {

constexpr int kLanes = 16;  // independent partial sums: vector code without -ffast-math

template <Metric M>
inline float term(float x, float w, float eps) {
  if constexpr (M == Metric::L2) return x * x;
  else if constexpr (M == Metric::Relative) return std::fabs(x) / (std::fabs(w) + eps);
  else return std::fabs(x);
}

template <Metric M>
inline float fold(float a, float t) {
  if constexpr (M == Metric::Max) return a > t ? a : t;
  else return a + t;
}

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f vabs(v8f x) { return (v8f)((v8i)x & 0x7fffffff); }

template <Metric M> inline v8f vterm(v8f x, v8f w, float eps) {
  if constexpr (M == Metric::L2) return x * x;
  else if constexpr (M == Metric::Relative) return vabs(x) / (vabs(w) + eps);
  else return vabs(x);
}

template <Metric M> inline v8f vfold(v8f a, v8f t) {
  if constexpr (M == Metric::Max) return a > t ? a : t;
  else return a + t;
}

template <typename T> inline v8f load8(const T* p) {
  float f[8];
  for (int j = 0; j < 8; ++j) f[j] = to_f(p[j]);
  v8f v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

// Lane j (of 16, in two 8-wide vectors) accumulates elements j, j + 16, ...; the lanes are then
// folded in order: the same bits whatever instructions the compiler picked for the vectors.
template <Metric M, typename T>
OSP_HOT float score_block(const T* __restrict__ g, const T* __restrict__ w, int64_t len, float eps,
                          float* nf_out) {
  v8f a0 = {}, a1 = {}, n0 = {}, n1 = {}, w0 = {}, w1 = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    const v8f x0 = load8(g + i), x1 = load8(g + i + 8);
    if constexpr (M == Metric::Relative) { w0 = load8(w + i); w1 = load8(w + i + 8); }
    a0 = vfold<M>(a0, vterm<M>(x0, w0, eps));
    a1 = vfold<M>(a1, vterm<M>(x1, w1, eps));
    n0 += x0 * 0.f;  // x * 0 is nan exactly when x is inf or nan
    n1 += x1 * 0.f;
  }
  float s = 0.f, z = 0.f;
  for (int j = 0; j < 8; ++j) { s = fold<M>(s, a0[j]); z += n0[j]; }
  for (int j = 0; j < 8; ++j) { s = fold<M>(s, a1[j]); z += n1[j]; }
  for (; i < len; ++i) {
    const float x = to_f(g[i]);
    s = fold<M>(s, term<M>(x, M == Metric::Relative ? to_f(w[i]) : 0.f, eps));
    z += x * 0.f;
  }
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

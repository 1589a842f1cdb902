// Exact torch.optim steps (SGD, Adam, AdamW) on packed buffers, for the LGP correction.
// Each line mirrors one tensor op of torch.optim's single-tensor path, in the same order, with the
// same fused multiply-adds as ATen's CPU kernels (add with alpha, lerp, addcmul use fmadd;
// mul, div, addcdiv do not) and rounding to T wherever torch.optim materialises a tensor, so the
// result matches torch.optim bit for bit on the CPU. Adam's square root is torch's own (the caller's
// SqrtF32, see ops.h): torch's fp32 sqrt is MKL's, which is not correctly rounded.
#include "common_cpu.h"

#include <type_traits>

namespace osp {
namespace cpu {
namespace {

constexpr int64_t kGrain = int64_t(1) << 15;

// ATen casts the alpha of add(a, b, alpha) to the tensor's dtype; other scalars stay fp32.
template <typename T> float alpha(double a) { return static_cast<float>(static_cast<T>(static_cast<float>(a))); }

struct SgdScalars {
  float wd, mom, mom_alpha, damp1, neg_lr;
};

// One element of torch.optim.SGD's step: the new parameter (before rounding to T) from the parameter
// p, gradient g and momentum m (read unless FIRST); the new momentum goes to *b.
template <typename T, bool MAXIMIZE, bool WD, bool MOMENTUM, bool FIRST, bool NESTEROV>
inline __attribute__((always_inline)) float sgd_elem(float p, float g, float m, float* b, const SgdScalars& s) {
  if constexpr (MAXIMIZE) g = -g;
  if constexpr (WD) g = rnd<T>(std::fma(p, s.wd, g));
  if constexpr (MOMENTUM) {
    if constexpr (FIRST) *b = g;
    else *b = rnd<T>(std::fma(g, s.damp1, rnd<T>(m * s.mom)));
    if constexpr (NESTEROV) g = rnd<T>(std::fma(*b, s.mom_alpha, g));
    else g = *b;
  }
  return std::fma(g, s.neg_lr, p);
}

// The flags are template parameters so the loop has no branches and vectorizes.
template <typename T, bool MAXIMIZE, bool WD, bool MOMENTUM, bool FIRST, bool NESTEROV>
OSP_HOT void sgd_range(T* P, const T* G, T* M, int64_t i0, int64_t i1, SgdScalars s) {
  for (int64_t i = i0; i < i1; ++i) {
    float b = 0.f;
    const float p = sgd_elem<T, MAXIMIZE, WD, MOMENTUM, FIRST, NESTEROV>(
        to_f(P[i]), to_f(G[i]), (MOMENTUM && !FIRST) ? to_f(M[i]) : 0.f, &b, s);
    if constexpr (MOMENTUM) M[i] = from_f<T>(b);
    P[i] = from_f<T>(p);
  }
}

// The same from separate inputs (Pin, Min) into separate outputs (P, M): no buffer is both.
template <typename T, bool MAXIMIZE, bool WD, bool MOMENTUM, bool FIRST, bool NESTEROV>
OSP_HOT void sgd_range_into(T* __restrict__ P, T* __restrict__ M, const T* __restrict__ Pin,
                            const T* __restrict__ Min, const T* __restrict__ G, int64_t len, SgdScalars s) {
  for (int64_t i = 0; i < len; ++i) {
    float b = 0.f;
    const float p = sgd_elem<T, MAXIMIZE, WD, MOMENTUM, FIRST, NESTEROV>(
        to_f(Pin[i]), to_f(G[i]), (MOMENTUM && !FIRST) ? to_f(Min[i]) : 0.f, &b, s);
    if constexpr (MOMENTUM) M[i] = from_f<T>(b);
    P[i] = from_f<T>(p);
  }
}

struct AdamScalars {
  float wd, decay, w1, b2, omb2, bc2s, eps, neg_step;
};

// Adam runs over pieces of kAdamPiece elements. The second moment of a piece comes first, then its square
// root by torch's own sqrt (SqrtF32, see ops.h: where torch has MKL it is not correctly rounded, std::sqrt
// is), then the first moment and the parameters. One loop does the last of these for one piece together
// with the second moment of the next (software pipelining): its divisions overlap the memory traffic of
// both, as in one fused pass over the elements.
constexpr int64_t kAdamPiece = 8192;

#define OSP_INLINE inline __attribute__((always_inline))

// The gradient as torch.optim's Adam uses it: negated (maximize), plus the weight decay (Adam's).
template <typename T, bool MAXIMIZE, bool WD, bool DECOUPLED>
OSP_INLINE float adam_grad(const T* P, const T* G, int64_t i, const AdamScalars& s) {
  float g = to_f(G[i]);
  if constexpr (MAXIMIZE) g = -g;
  if constexpr (WD && !DECOUPLED) g = rnd<T>(std::fma(to_f(P[i]), s.wd, g));
  return g;
}

// exp_avg_sq (and max_exp_avg_sq) of element i, in place.
template <typename T, bool MAXIMIZE, bool WD, bool DECOUPLED, bool AMSGRAD>
OSP_INLINE void adam_second(const T* P, const T* G, T* ES, T* MX, int64_t i, const AdamScalars& s) {
  const float g = adam_grad<T, MAXIMIZE, WD, DECOUPLED>(P, G, i, s);
  float v = rnd<T>(to_f(ES[i]) * s.b2);
  v = rnd<T>(std::fma(s.omb2 * g, g, v));
  ES[i] = from_f<T>(v);
  if constexpr (AMSGRAD) {
    const float m0 = to_f(MX[i]);
    // torch.maximum: nan if either is nan (m0 + v is nan then); written as selects that vectorize
    const float nan = m0 + v;
    float mx = m0 > v ? m0 : v;
    mx = m0 != m0 ? nan : mx;
    MX[i] = from_f<T>(v != v ? nan : mx);
  }
}

// exp_avg and the parameter of element i, in place; r: the square root (rounded to T) of what Adam
// divides by (exp_avg_sq, or max_exp_avg_sq with amsgrad).
template <typename T, bool MAXIMIZE, bool WD, bool DECOUPLED, bool SMALL>
OSP_INLINE void adam_update(T* P, const T* G, T* EA, float r, int64_t i, const AdamScalars& s) {
  const float g = adam_grad<T, MAXIMIZE, WD, DECOUPLED>(P, G, i, s);
  const float e0 = to_f(EA[i]);
  const float d = g - e0;
  const float e = rnd<T>(SMALL ? std::fma(s.w1, d, e0) : std::fma(s.w1 - 1.f, d, g));
  EA[i] = from_f<T>(e);
  float p = to_f(P[i]);
  if constexpr (WD && DECOUPLED) p = rnd<T>(p * s.decay);
  float den = rnd<T>(r / s.bc2s);
  den = rnd<T>(den + s.eps);
  P[i] = from_f<T>(p + (s.neg_step * e) / den);
}

// The update of elements u .. u + nu (square roots R[0 .. nu]) and the second moment of elements
// v .. v + nv, the first min(nu, nv) of each in one loop. The flags are template parameters so the loops
// have no branches and vectorize.
template <typename T, bool MAXIMIZE, bool WD, bool DECOUPLED, bool AMSGRAD, bool SMALL>
OSP_HOT void adam_pipe(T* P, const T* G, T* EA, T* ES, T* MX, const float* R, int64_t u, int64_t nu, int64_t v,
                       int64_t nv, AdamScalars s) {
  const int64_t m = std::min(nu, nv);
  // The two element ranges do not overlap: restrict-qualified pointers to each (so the loop needs no
  // runtime aliasing checks, of which it would need more than the compiler makes).
  auto both = [m, &s](T* __restrict__ Pu, const T* __restrict__ Gu, T* __restrict__ EAu, const float* __restrict__ Ru,
                      const T* __restrict__ Pv, const T* __restrict__ Gv, T* __restrict__ ESv, T* __restrict__ MXv) {
    for (int64_t k = 0; k < m; ++k) {
      adam_update<T, MAXIMIZE, WD, DECOUPLED, SMALL>(Pu, Gu, EAu, Ru[k], k, s);
      adam_second<T, MAXIMIZE, WD, DECOUPLED, AMSGRAD>(Pv, Gv, ESv, MXv, k, s);
    }
  };
  both(P + u, G + u, EA + u, R, P + v, G + v, ES + v, AMSGRAD ? MX + v : nullptr);
  for (int64_t k = m; k < nu; ++k) adam_update<T, MAXIMIZE, WD, DECOUPLED, SMALL>(P, G, EA, R[k], u + k, s);
  for (int64_t k = m; k < nv; ++k) adam_second<T, MAXIMIZE, WD, DECOUPLED, AMSGRAD>(P, G, ES, MX, v + k, s);
}

// R[k] = sqrt(X[k]) for k < len, as torch's sqrt computes it on a tensor of dtype T: in fp32 torch's own
// (sqrt_f32); in fp16/bf16 torch's is correctly rounded in fp32, then rounded to T.
template <typename T> void adam_sqrt(float* R, const T* X, int64_t len, SqrtF32 sqrt_f32) {
  if constexpr (std::is_same_v<T, float>) {
    if (sqrt_f32 != nullptr) return sqrt_f32(R, X, len);
  }
  for (int64_t k = 0; k < len; ++k) R[k] = rnd<T>(std::sqrt(to_f(X[k])));
}

// Turns runtime flags into the template arguments of a kernel loop: Pick<K, T>::get(flags...)
// returns &K::template fn<T, flags...>.
template <typename K, typename T, bool... B> struct Pick {
  template <typename... Rest>
  static auto get(bool b, Rest... rest) {
    return b ? Pick<K, T, B..., true>::get(rest...) : Pick<K, T, B..., false>::get(rest...);
  }
  static auto get() { return &K::template fn<T, B...>; }
};
struct SgdLoop {
  template <typename T, bool... B> static void fn(T* P, const T* G, T* M, int64_t i0, int64_t i1, SgdScalars s) {
    sgd_range<T, B...>(P, G, M, i0, i1, s);
  }
};
struct SgdIntoLoop {
  template <typename T, bool... B>
  static void fn(T* P, T* M, const T* Pin, const T* Min, const T* G, int64_t len, SgdScalars s) {
    sgd_range_into<T, B...>(P, M, Pin, Min, G, len, s);
  }
};
struct AdamPipe {
  template <typename T, bool... B>
  static void fn(T* P, const T* G, T* EA, T* ES, T* MX, const float* R, int64_t u, int64_t nu, int64_t v,
                 int64_t nv, AdamScalars s) {
    adam_pipe<T, B...>(P, G, EA, ES, MX, R, u, nu, v, nv, s);
  }
};

}  // namespace

static SgdScalars sgd_scalars_for(DType dt, const SgdHyper& h) {
  SgdScalars sc{};
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    sc = SgdScalars{alpha<T>(h.weight_decay), float(h.momentum), alpha<T>(h.momentum),
                    alpha<T>(1.0 - h.dampening), alpha<T>(-h.lr)};
  });
  return sc;
}

void sgd_step(DType dt, void* param, const void* grad, void* momentum_buf, int64_t n,
              const SgdHyper& h) {
  const SgdScalars sc = sgd_scalars_for(dt, h);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto P = static_cast<T*>(param);
    auto G = static_cast<const T*>(grad);
    auto M = h.momentum != 0.0 ? static_cast<T*>(momentum_buf) : nullptr;
    auto fn = Pick<SgdLoop, T>::get(h.maximize, h.weight_decay != 0.0, M != nullptr, h.first,
                                    h.nesterov);
    at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) { fn(P, G, M, i0, i1, sc); });
  });
}

void sgd_step_into(DType dt, void* param, void* momentum_buf, const void* snap_param,
                   const void* snap_momentum, const void* grad, const uint8_t* mask, int64_t n, int64_t bs,
                   const SgdHyper& h) {
  const SgdScalars sc = sgd_scalars_for(dt, h);
  const auto pos = side_offsets(mask, n, bs);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto P = static_cast<T*>(param);
    auto M = h.momentum != 0.0 ? static_cast<T*>(momentum_buf) : nullptr;
    auto Pin = static_cast<const T*>(snap_param);
    auto Min = M != nullptr && !h.first ? static_cast<const T*>(snap_momentum) : nullptr;
    auto G = static_cast<const T*>(grad);
    auto fn = Pick<SgdIntoLoop, T>::get(h.maximize, h.weight_decay != 0.0, M != nullptr, h.first,
                                        h.nesterov);
    at::parallel_for(0, num_blocks(n, bs), block_grain(bs), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        if (mask[b]) continue;
        const int64_t o = pos[b];
        fn(P + b * bs, M ? M + b * bs : nullptr, Pin + o, Min ? Min + o : nullptr, G + o, block_len(b, n, bs),
           sc);
      }
    });
  });
}

void adam_step(DType dt, void* param, const void* grad, void* exp_avg, void* exp_avg_sq,
               void* max_exp_avg_sq, int64_t n, const AdamHyper& h, SqrtF32 sqrt_f32) {
  // Scalars exactly as torch.optim.adam computes them in Python (double), then cast once.
  const double bc1 = 1.0 - std::pow(h.beta1, h.step);
  const double bc2 = 1.0 - std::pow(h.beta2, h.step);
  const double step_size = h.lr / bc1;
  const double bc2_sqrt = std::pow(bc2, 0.5);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    const AdamScalars sc{alpha<T>(h.weight_decay), float(1.0 - h.lr * h.weight_decay),
                         float(1.0 - h.beta1), float(h.beta2), float(1.0 - h.beta2),
                         float(bc2_sqrt), float(h.eps), float(-step_size)};
    auto pipe = Pick<AdamPipe, T>::get(h.maximize, h.weight_decay != 0.0, h.decoupled, h.amsgrad,
                                       std::fabs(sc.w1) < 0.5f);
    auto P = static_cast<T*>(param);
    auto G = static_cast<const T*>(grad);
    auto EA = static_cast<T*>(exp_avg), ES = static_cast<T*>(exp_avg_sq), MX = static_cast<T*>(max_exp_avg_sq);
    const T* V = h.amsgrad ? MX : ES;  // what Adam divides by
    at::parallel_for(0, n, kAdamPiece, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> buf(2 * kAdamPiece);
      float *R = buf.data(), *Rnext = R + kAdamPiece;
      // the second moment of the first piece, alone; then each piece's update with the next one's
      int64_t a = i0, b = std::min(i0 + kAdamPiece, i1);
      pipe(P, G, EA, ES, MX, R, a, 0, a, b - a, sc);
      adam_sqrt<T>(R, V + a, b - a, sqrt_f32);
      while (a < i1) {
        const int64_t c = b, d = std::min(b + kAdamPiece, i1);
        pipe(P, G, EA, ES, MX, R, a, b - a, c, d - c, sc);
        if (d > c) adam_sqrt<T>(Rnext, V + c, d - c, sqrt_f32);
        std::swap(R, Rnext);
        a = c;
        b = d;
      }
    });
  });
}

}  // namespace cpu
}  // namespace osp

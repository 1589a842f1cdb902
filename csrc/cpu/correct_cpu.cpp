// Exact torch.optim steps (SGD, Adam, AdamW) on packed buffers, for the LGP correction.
// Each line mirrors one tensor op of torch.optim's single-tensor path, in the same order, with the
// same fused multiply-adds as ATen's CPU kernels (add with alpha, lerp, addcmul use fmadd;
// mul, div, addcdiv do not) and rounding to T wherever torch.optim materialises a tensor, so the
// result matches torch.optim bit for bit on the CPU.
#include "common_cpu.h"

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

// The flags are template parameters so the loop has no branches and vectorizes.
template <typename T, bool MAXIMIZE, bool WD, bool DECOUPLED, bool AMSGRAD, bool SMALL>
OSP_HOT void adam_range(T* P, const T* G, T* EA, T* ES, T* MX, int64_t i0, int64_t i1,
                        AdamScalars s) {
  for (int64_t i = i0; i < i1; ++i) {
    float g = to_f(G[i]);
    if constexpr (MAXIMIZE) g = -g;
    float p = to_f(P[i]);
    if constexpr (WD) {
      if constexpr (DECOUPLED) p = rnd<T>(p * s.decay);
      else g = rnd<T>(std::fma(p, s.wd, g));
    }
    const float e0 = to_f(EA[i]);
    const float d = g - e0;
    const float e = rnd<T>(SMALL ? std::fma(s.w1, d, e0) : std::fma(s.w1 - 1.f, d, g));
    float v = rnd<T>(to_f(ES[i]) * s.b2);
    v = rnd<T>(std::fma(s.omb2 * g, g, v));
    EA[i] = from_f<T>(e);
    ES[i] = from_f<T>(v);
    if constexpr (AMSGRAD) {
      const float m0 = to_f(MX[i]);
      // torch.maximum: nan if either is nan (m0 + v is nan then)
      v = (m0 != m0 || v != v) ? m0 + v : (m0 > v ? m0 : v);
      MX[i] = from_f<T>(v);
    }
    float den = rnd<T>(std::sqrt(v));
    den = rnd<T>(den / s.bc2s);
    den = rnd<T>(den + s.eps);
    P[i] = from_f<T>(p + (s.neg_step * e) / den);
  }
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
struct AdamLoop {
  template <typename T, bool... B>
  static void fn(T* P, const T* G, T* EA, T* ES, T* MX, int64_t i0, int64_t i1, AdamScalars s) {
    adam_range<T, B...>(P, G, EA, ES, MX, i0, i1, s);
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
               void* max_exp_avg_sq, int64_t n, const AdamHyper& h) {
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
    const bool small = std::fabs(sc.w1) < 0.5f;
    auto fn = Pick<AdamLoop, T>::get(h.maximize, h.weight_decay != 0.0, h.decoupled, h.amsgrad, small);
    at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
      fn(static_cast<T*>(param), static_cast<const T*>(grad), static_cast<T*>(exp_avg),
         static_cast<T*>(exp_avg_sq), static_cast<T*>(max_exp_avg_sq), i0, i1, sc);
    });
  });
}

}  // namespace cpu
}  // namespace osp

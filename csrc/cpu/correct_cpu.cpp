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

template <typename T>
OSP_HOT void sgd_range(T* P, const T* G, T* M, int64_t i0, int64_t i1, float wd, float mom,
                       float mom_alpha, float damp1, float neg_lr, bool nesterov, bool maximize,
                       bool first) {
  for (int64_t i = i0; i < i1; ++i) {
    float g = to_f(G[i]);
    if (maximize) g = -g;
    const float p = to_f(P[i]);
    if (wd != 0.f) g = rnd<T>(std::fma(p, wd, g));
    if (M) {
      float b = first ? g : rnd<T>(std::fma(g, damp1, rnd<T>(to_f(M[i]) * mom)));
      M[i] = static_cast<T>(b);
      g = nesterov ? rnd<T>(std::fma(b, mom_alpha, g)) : b;
    }
    P[i] = static_cast<T>(std::fma(g, neg_lr, p));
  }
}

template <typename T>
OSP_HOT void adam_range(T* P, const T* G, T* EA, T* ES, T* MX, int64_t i0, int64_t i1, float wd,
                        float decay, float w1, float b2, float omb2, float bc2s, float eps,
                        float neg_step, bool maximize, bool decoupled) {
  const bool small = std::fabs(w1) < 0.5f;
  for (int64_t i = i0; i < i1; ++i) {
    float g = to_f(G[i]);
    if (maximize) g = -g;
    float p = to_f(P[i]);
    if (wd != 0.f) {
      if (decoupled) p = rnd<T>(p * decay);
      else g = rnd<T>(std::fma(p, wd, g));
    }
    const float e0 = to_f(EA[i]);
    const float d = g - e0;
    const float e = rnd<T>(small ? std::fma(w1, d, e0) : std::fma(w1 - 1.f, d, g));
    float v = rnd<T>(to_f(ES[i]) * b2);
    v = rnd<T>(std::fma(omb2 * g, g, v));
    EA[i] = static_cast<T>(e);
    ES[i] = static_cast<T>(v);
    if (MX) {
      const float m0 = to_f(MX[i]);
      v = (std::isnan(m0) || std::isnan(v)) ? NAN : (m0 > v ? m0 : v);
      MX[i] = static_cast<T>(v);
    }
    float den = rnd<T>(std::sqrt(v));
    den = rnd<T>(den / bc2s);
    den = rnd<T>(den + eps);
    P[i] = static_cast<T>(p + (neg_step * e) / den);
  }
}

}  // namespace

void sgd_step(DType dt, void* param, const void* grad, void* momentum_buf, int64_t n,
              const SgdHyper& h) {
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto P = static_cast<T*>(param);
    auto G = static_cast<const T*>(grad);
    auto M = h.momentum != 0.0 ? static_cast<T*>(momentum_buf) : nullptr;
    at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
      sgd_range<T>(P, G, M, i0, i1, alpha<T>(h.weight_decay), float(h.momentum),
                   alpha<T>(h.momentum), alpha<T>(1.0 - h.dampening), alpha<T>(-h.lr), h.nesterov,
                   h.maximize, h.first);
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
    auto MX = h.amsgrad ? static_cast<T*>(max_exp_avg_sq) : nullptr;
    at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
      adam_range<T>(static_cast<T*>(param), static_cast<const T*>(grad), static_cast<T*>(exp_avg),
                    static_cast<T*>(exp_avg_sq), MX, i0, i1, alpha<T>(h.weight_decay),
                    float(1.0 - h.lr * h.weight_decay), float(1.0 - h.beta1), float(h.beta2),
                    float(1.0 - h.beta2), float(bc2_sqrt), float(h.eps), float(-step_size),
                    h.maximize, h.decoupled);
    });
  });
}

}  // namespace cpu
}  // namespace osp

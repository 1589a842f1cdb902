// Exact SGD / Adam / AdamW steps on packed buffers for the LGP correction, elementwise, written in
// the operation order of torch.optim's single-tensor CPU path (csrc/cpu/correct_cpu.cpp). torch's
// CUDA optimizers run foreach kernels whose roundings (nvcc's contracted multiply-adds among them)
// can differ in the last bit, so on a GPU the corrected update equals torch.optim's to float
// tolerance, not bitwise. Every rank runs this same kernel, so the replicas stay bitwise equal.
#include <cmath>

#include "common_cuda.cuh"

namespace osp {
namespace cuda {
namespace {

template <typename T>
__global__ void sgd_step_kernel(T* __restrict__ P, const T* __restrict__ G, T* __restrict__ M, int64_t n,
                                float wd, float mom, float damp1, float neg_lr, bool nesterov,
                                bool maximize, bool first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float g = to_f(G[i]);
    if (maximize) g = -g;
    const float p = to_f(P[i]);
    if (wd != 0.f) g = rnd<T>(fmaf(p, wd, g));
    if (M) {
      const float b = first ? g : rnd<T>(fmaf(g, damp1, rnd<T>(__fmul_rn(to_f(M[i]), mom))));
      M[i] = from_f<T>(b);
      g = nesterov ? rnd<T>(fmaf(b, mom, g)) : b;
    }
    P[i] = from_f<T>(fmaf(g, neg_lr, p));
  }
}

template <typename T>
__global__ void adam_step_kernel(T* __restrict__ P, const T* __restrict__ G, T* __restrict__ EA,
                                 T* __restrict__ ES, T* __restrict__ MX, int64_t n, float wd,
                                 float decay, float w1, float b2, float omb2, float bc2s, float eps,
                                 float neg_step, bool maximize, bool decoupled) {
  const bool small = fabsf(w1) < 0.5f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float g = to_f(G[i]);
    if (maximize) g = -g;
    float p = to_f(P[i]);
    if (wd != 0.f) {
      if (decoupled) p = rnd<T>(__fmul_rn(p, decay));
      else g = rnd<T>(fmaf(p, wd, g));
    }
    const float e0 = to_f(EA[i]);
    const float d = __fsub_rn(g, e0);
    const float e = rnd<T>(small ? fmaf(w1, d, e0) : fmaf(w1 - 1.f, d, g));
    float v = rnd<T>(__fmul_rn(to_f(ES[i]), b2));
    v = rnd<T>(fmaf(__fmul_rn(omb2, g), g, v));
    EA[i] = from_f<T>(e);
    ES[i] = from_f<T>(v);
    if (MX) {
      const float m0 = to_f(MX[i]);
      v = (isnan(m0) || isnan(v)) ? NAN : (m0 > v ? m0 : v);
      MX[i] = from_f<T>(v);
    }
    float den = rnd<T>(__fsqrt_rn(v));
    den = rnd<T>(__fdiv_rn(den, bc2s));
    den = rnd<T>(__fadd_rn(den, eps));
    P[i] = from_f<T>(__fadd_rn(p, __fdiv_rn(__fmul_rn(neg_step, e), den)));
  }
}

}  // namespace

void sgd_step(DType dt, void* param, const void* grad, void* momentum_buf, int64_t n,
              const SgdHyper& h, void* stream) {
  if (n == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    sgd_step_kernel<T><<<grid_for(n), kThreads, 0, as_stream(stream)>>>(
        static_cast<T*>(param), static_cast<const T*>(grad),
        h.momentum != 0.0 ? static_cast<T*>(momentum_buf) : nullptr, n, float(h.weight_decay),
        float(h.momentum), float(1.0 - h.dampening), float(-h.lr), h.nesterov, h.maximize, h.first);
    check_launch("sgd_step_kernel");
  });
}

void adam_step(DType dt, void* param, const void* grad, void* exp_avg, void* exp_avg_sq,
               void* max_exp_avg_sq, int64_t n, const AdamHyper& h, void* stream) {
  if (n == 0) return;
  const double bc1 = 1.0 - std::pow(h.beta1, h.step);
  const double bc2 = 1.0 - std::pow(h.beta2, h.step);
  const double step_size = h.lr / bc1;
  const double bc2_sqrt = std::pow(bc2, 0.5);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    adam_step_kernel<T><<<grid_for(n), kThreads, 0, as_stream(stream)>>>(
        static_cast<T*>(param), static_cast<const T*>(grad), static_cast<T*>(exp_avg),
        static_cast<T*>(exp_avg_sq), h.amsgrad ? static_cast<T*>(max_exp_avg_sq) : nullptr, n,
        float(h.weight_decay), float(1.0 - h.lr * h.weight_decay), float(1.0 - h.beta1),
        float(h.beta2), float(1.0 - h.beta2), float(bc2_sqrt), float(h.eps), float(-step_size),
        h.maximize, h.decoupled);
    check_launch("adam_step_kernel");
  });
}

}  // namespace cuda
}  // namespace osp

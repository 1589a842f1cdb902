// Exact SGD / Adam / AdamW steps on packed buffers for the LGP correction, elementwise, written in
// the operation order of torch.optim's single-tensor CPU path (csrc/cpu/correct_cpu.cpp). torch's
// CUDA optimizers run foreach kernels whose roundings (nvcc's contracted multiply-adds among them)
// can differ in the last bit, so on a GPU the corrected update equals torch.optim's to float
// tolerance, not bitwise. Every rank runs this same kernel, so the replicas stay bitwise equal.
// sgd_step_ and adam_step_ are grid-stride loops over the elements; sgd_step_into_ runs over the
// (block, chunk) items of ../launch.h with the host's block count, as merge_blocks does.
#include <cmath>

#include "common_cuda.cuh"

namespace osp {
namespace cuda {
namespace {

// One element of torch.optim.SGD's step: the new parameter from p, g and the momentum m (read unless
// first; null M: no momentum); the new momentum goes to *b.
template <typename T>
__device__ __forceinline__ float sgd_elem(float p, float g, float m, bool has_m, float* b, float wd, float mom,
                                          float damp1, float neg_lr, bool nesterov, bool maximize, bool first) {
  if (maximize) g = -g;
  if (wd != 0.f) g = rnd<T>(fmaf(p, wd, g));
  if (has_m) {
    *b = first ? g : rnd<T>(fmaf(g, damp1, rnd<T>(__fmul_rn(m, mom))));
    g = nesterov ? rnd<T>(fmaf(*b, mom, g)) : *b;
  }
  return fmaf(g, neg_lr, p);
}

template <typename T>
__global__ void sgd_step_kernel(T* __restrict__ P, const T* __restrict__ G, T* __restrict__ M, int64_t n,
                                float wd, float mom, float damp1, float neg_lr, bool nesterov,
                                bool maximize, bool first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float b = 0.f;
    const float p = sgd_elem<T>(to_f(P[i]), to_f(G[i]), M && !first ? to_f(M[i]) : 0.f, M != nullptr, &b, wd,
                                mom, damp1, neg_lr, nesterov, maximize, first);
    if (M) M[i] = from_f<T>(b);
    P[i] = from_f<T>(p);
  }
}

// Over the launch shape of ../launch.h (a grid over (block, chunk) items; the host's block count): the
// deferred (mask == 0) block b starts at b - (pos[b] - pos[0]) whole blocks in the packed inputs, as in
// merge_blocks; a block whose position is impossible or that reaches past packed_n is skipped.
template <typename T>
__global__ void __launch_bounds__(kThreads) sgd_step_into_kernel(
    const launch::Shape s, T* __restrict__ P, T* __restrict__ M, const T* __restrict__ Pin,
    const T* __restrict__ Min, const T* __restrict__ G, const uint8_t* __restrict__ mask,
    const int64_t* __restrict__ pos, int64_t n, int64_t bs, int64_t packed_n, float wd, float mom, float damp1,
    float neg_lr, bool nesterov, bool maximize, bool first) {
  const int slot = threadIdx.x / s.group, lane = threadIdx.x & (s.group - 1);
  const int64_t p0 = pos[0];
  for (int64_t cta = blockIdx.x; cta < s.ctas; cta += gridDim.x) {
    const int64_t q = launch::item_index(s, cta, slot);
    if (q >= s.items) continue;
    const launch::Item it = launch::item_at(s, q);
    const int64_t b = it.row, sel_before = pos[b] - p0;
    if (mask[b] != 0 || sel_before < 0 || sel_before > b) continue;
    const int64_t o = (b - sel_before) * bs, len = block_len(b, n, bs), hi = launch::item_end(s, it, len);
    if (o + len > packed_n) continue;
    const int64_t f = b * bs;
    for (int64_t i = it.lo + lane; i < hi; i += s.group) {
      float m = 0.f;
      const float p = sgd_elem<T>(to_f(Pin[o + i]), to_f(G[o + i]), Min && !first ? to_f(Min[o + i]) : 0.f,
                                  M != nullptr, &m, wd, mom, damp1, neg_lr, nesterov, maximize, first);
      if (M) M[f + i] = from_f<T>(m);
      P[f + i] = from_f<T>(p);
    }
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

void sgd_step_into(DType dt, void* param, void* momentum_buf, const void* snap_param,
                   const void* snap_momentum, const void* grad, const uint8_t* mask, const int64_t* pos,
                   int64_t n, int64_t bs, int64_t packed_n, const SgdHyper& h, void* stream) {
  const launch::Shape s = launch::shape(n, bs);
  if (s.items == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    const bool has_m = h.momentum != 0.0;
    sgd_step_into_kernel<T><<<grid_of(s), kThreads, 0, as_stream(stream)>>>(
        s, static_cast<T*>(param), has_m ? static_cast<T*>(momentum_buf) : nullptr,
        static_cast<const T*>(snap_param), has_m && !h.first ? static_cast<const T*>(snap_momentum) : nullptr,
        static_cast<const T*>(grad), mask, pos, n, bs, packed_n, float(h.weight_decay), float(h.momentum),
        float(1.0 - h.dampening), float(-h.lr), h.nesterov, h.maximize, h.first);
    check_launch("sgd_step_into_kernel");
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

// The CUDA implementations of osp's ops (schemas in ../bindings.cpp): the shared input checks, then
// the CUDA launchers on the current stream of the tensors' device. Built only with CUDA.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "../checks.h"
#include "../ops.h"

namespace osp {
namespace {
using namespace checks;

void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// Validates the ids' values on the device (one sync); returns the packed length they select.
int64_t validate_ids_cuda(const at::Tensor& ids, const at::Tensor& flat, int64_t bs) {
  const int64_t nb = check_ids_shape(ids, flat, bs), nids = ids.numel();
  if (nids == 0) return 0;
  c10::cuda::CUDAGuard guard(ids.device());
  auto seen = at::zeros({nb}, ids.options().dtype(at::kInt));
  auto bad = at::zeros({1}, ids.options().dtype(at::kInt));
  cuda::check_ids(ids.data_ptr<int64_t>(), nids, nb, seen.data_ptr<int32_t>(), bad.data_ptr<int32_t>(),
                  stream_of(ids));
  const int32_t b = bad.item<int32_t>();
  TORCH_CHECK(!(b & 1), "osp: block_ids holds an id out of range: expected 0 <= id < ", nb, ", got min ",
              ids.min().item<int64_t>(), " and max ", ids.max().item<int64_t>());
  TORCH_CHECK(!(b & 2), "osp: block_ids holds an id more than once");
  return packed_length(nids, nb, bs, flat.numel(), seen[nb - 1].item<int32_t>() != 0);
}

// Position in ids of the short last block, or -1 (one device sync, only when n % bs != 0).
int64_t short_position(const at::Tensor& ids, int64_t n, int64_t bs) {
  if (n % bs == 0 || ids.numel() == 0) return -1;
  auto hit = (ids == num_blocks(n, bs) - 1).nonzero();
  return hit.numel() ? hit[0][0].item<int64_t>() : -1;
}

// On a device the packed lengths would cost a sync every call: the buffers' own lengths are taken as
// given (osp's buffers hold whole blocks) and the kernels never read or write past them.
std::pair<int64_t, int64_t> unchecked_lengths(const at::Tensor&, int64_t, int64_t) { return {-1, -1}; }

at::Tensor exclusive_positions(const at::Tensor& m8) { return m8.cumsum(0, at::kLong) - m8.to(at::kLong); }

std::tuple<at::Tensor, at::Tensor> score_blocks_cuda(const at::Tensor& grad,
                                                     const c10::optional<at::Tensor>& param, int64_t bs,
                                                     int64_t metric, double eps) {
  const auto [dt, w] = check_score(grad, param, bs, metric);
  const int64_t n = grad.numel();
  auto scores = at::empty({num_blocks(n, bs)}, grad.options().dtype(at::kFloat));
  auto nonfinite = at::zeros({1}, grad.options().dtype(at::kInt));
  if (n == 0) return {scores, nonfinite};
  c10::cuda::CUDAGuard guard(grad.device());
  cuda::score_blocks(dt, grad.data_ptr(), w, n, bs, static_cast<Metric>(metric), float(eps),
                     scores.data_ptr<float>(), nonfinite.data_ptr<int32_t>(), stream_of(grad));
  return {scores, nonfinite};
}

void pack_blocks_cuda(const at::Tensor& flat, const at::Tensor& ids, int64_t bs, const at::Tensor& out) {
  const DType dt = check_flat(flat, bs);
  const int64_t len = validate_ids_cuda(ids, flat, bs);
  check_packed(flat, out, "out", len, /*into_flat=*/false);
  if (len == 0) return;
  c10::cuda::CUDAGuard guard(flat.device());
  cuda::pack_blocks(dt, flat.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs,
                    short_position(ids, flat.numel(), bs), out.data_ptr(), stream_of(flat));
}

void unpack_blocks_cuda(const at::Tensor& buf, const at::Tensor& ids, int64_t bs, const at::Tensor& flat,
                        bool accumulate) {
  const DType dt = check_flat(flat, bs);
  const int64_t len = validate_ids_cuda(ids, flat, bs);
  check_packed(flat, buf, "buf", len, /*into_flat=*/true);
  if (len == 0) return;
  c10::cuda::CUDAGuard guard(flat.device());
  cuda::unpack_blocks(dt, buf.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs,
                      short_position(ids, flat.numel(), bs), flat.data_ptr(), accumulate, stream_of(flat));
}

void split_blocks_cuda(const at::Tensor& flat, const at::Tensor& mask, int64_t bs,
                       const c10::optional<at::Tensor>& crit, const c10::optional<at::Tensor>& def) {
  const auto m8 = check_split(flat, mask, bs, crit, def, /*into_flat=*/false, unchecked_lengths);
  if (flat.numel() == 0) return;
  c10::cuda::CUDAGuard guard(flat.device());
  const auto pos = exclusive_positions(m8);
  cuda::split_blocks(to_dtype(flat, "flat"), flat.data_ptr(), flat.numel(), m8.data_ptr<uint8_t>(),
                     pos.data_ptr<int64_t>(), bs, data_or_null(crit), crit ? crit->numel() : 0,
                     data_or_null(def), def ? def->numel() : 0, stream_of(flat));
}

void merge_blocks_cuda(const c10::optional<at::Tensor>& crit, const c10::optional<at::Tensor>& def,
                       const at::Tensor& mask, int64_t bs, const at::Tensor& flat) {
  const auto m8 = check_split(flat, mask, bs, crit, def, /*into_flat=*/true, unchecked_lengths);
  if (flat.numel() == 0) return;
  c10::cuda::CUDAGuard guard(flat.device());
  const auto pos = exclusive_positions(m8);
  cuda::merge_blocks(to_dtype(flat, "flat"), data_or_null(crit), crit ? crit->numel() : 0, data_or_null(def),
                     def ? def->numel() : 0, m8.data_ptr<uint8_t>(), pos.data_ptr<int64_t>(), flat.numel(),
                     bs, flat.data_ptr(), stream_of(flat));
}

void sgd_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                   const c10::optional<at::Tensor>& momentum_buffer, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, bool maximize, bool first) {
  void* m = check_sgd(param, grad, momentum_buffer, momentum);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize, first};
  if (param.numel() == 0) return;
  c10::cuda::CUDAGuard guard(param.device());
  cuda::sgd_step(to_dtype(param, "param"), param.data_ptr(), grad.data_ptr(), m, param.numel(), h,
                 stream_of(param));
}

void sgd_step_into_cuda(const at::Tensor& param, const c10::optional<at::Tensor>& momentum_buffer,
                        const at::Tensor& snap_param, const c10::optional<at::Tensor>& snap_momentum,
                        const at::Tensor& grad, const at::Tensor& mask, int64_t bs, double lr, double momentum,
                        double dampening, double weight_decay, bool nesterov, bool maximize, bool first) {
  const auto m8 = check_sgd_into(param, momentum_buffer, snap_param, snap_momentum, grad, mask, bs, momentum,
                                 first, unchecked_lengths);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize, first};
  if (param.numel() == 0) return;
  c10::cuda::CUDAGuard guard(param.device());
  const auto pos = exclusive_positions(m8);
  int64_t packed_n = std::min(snap_param.numel(), grad.numel());
  if (momentum != 0.0 && !first) packed_n = std::min(packed_n, snap_momentum->numel());
  cuda::sgd_step_into(to_dtype(param, "param"), param.data_ptr(), momentum != 0.0 ? momentum_buffer->data_ptr()
                      : nullptr, snap_param.data_ptr(), data_or_null(snap_momentum), grad.data_ptr(),
                      m8.data_ptr<uint8_t>(), pos.data_ptr<int64_t>(), param.numel(), bs, packed_n, h,
                      stream_of(param));
}

void adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& max_exp_avg_sq,
                    double step, double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool amsgrad, bool maximize, bool decoupled) {
  void* mx = check_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, amsgrad);
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, step, amsgrad, maximize, decoupled};
  if (param.numel() == 0) return;
  c10::cuda::CUDAGuard guard(param.device());
  cuda::adam_step(to_dtype(param, "param"), param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                  exp_avg_sq.data_ptr(), mx, param.numel(), h, stream_of(param));
}

}  // namespace

TORCH_LIBRARY_IMPL(osp, CUDA, m) {
  m.impl("score_blocks", &score_blocks_cuda);
  m.impl("pack_blocks", &pack_blocks_cuda);
  m.impl("unpack_blocks", &unpack_blocks_cuda);
  m.impl("split_blocks", &split_blocks_cuda);
  m.impl("merge_blocks", &merge_blocks_cuda);
  m.impl("sgd_step_", &sgd_step_cuda);
  m.impl("sgd_step_into_", &sgd_step_into_cuda);
  m.impl("adam_step_", &adam_step_cuda);
}

}  // namespace osp

// The CUDA implementations of osp's ops (schemas in ../bindings.cpp): the shared input checks first
// (every tensor argument on the first one's device, named in the message, before any device guard or
// data pointer), then the CUDA launchers on the current stream of the tensors' device. split/merge/
// sgd_step_into take the mask's positions when given (ops.mask_positions, computed once per mask) and
// compute them otherwise. Built only with CUDA.
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

// After the shared checks (every tensor argument is on ref's device), before any data pointer is read.
c10::cuda::CUDAGuard cuda_guard(const at::Tensor& ref, const char* name) {
  TORCH_CHECK(ref.is_cuda(), "osp: ", name, " must be on a CUDA device for the CUDA kernels, got ", ref.device());
  return c10::cuda::CUDAGuard(ref.device());
}

// Validates the ids' values with one small kernel and one device-to-host read (a sync: pack/unpack are
// not on any training step's path). Returns the packed length they select; *short_pos gets the
// position in ids of the short last block, or -1. The ids' range goes into the message on error only.
int64_t validate_ids_cuda(const at::Tensor& ids, const at::Tensor& flat, int64_t bs, int64_t* short_pos) {
  const int64_t nb = check_ids_shape(ids, flat, bs), n = flat.numel(), nids = ids.numel();
  *short_pos = -1;
  if (nids == 0) return 0;
  auto guard = cuda_guard(ids, "block_ids");
  auto info = at::zeros({cuda::check_ids_words(nb)}, ids.options());
  cuda::check_ids(ids.data_ptr<int64_t>(), nids, nb, info.data_ptr<int64_t>(), stream_of(ids));
  const auto host = info.narrow(0, 0, 2).cpu();  // the one device-to-host read
  const int64_t bad = host.data_ptr<int64_t>()[0], last = host.data_ptr<int64_t>()[1];
  TORCH_CHECK(!(bad & 1), "osp: block_ids holds an id out of range: expected 0 <= id < ", nb, ", got min ",
              ids.min().item<int64_t>(), " and max ", ids.max().item<int64_t>());
  TORCH_CHECK(!(bad & 2), "osp: block_ids holds an id more than once");
  if (last > 0 && n % bs != 0) *short_pos = last - 1;
  return packed_length(nids, nb, bs, n, last > 0);
}

// On a device the packed lengths would cost a sync every call: the buffers' own lengths are taken as
// given (osp's buffers hold whole blocks) and the kernels never read or write past them.
std::pair<int64_t, int64_t> unchecked_lengths(const at::Tensor&, int64_t, int64_t) { return {-1, -1}; }

// The given positions, or the mask's exclusive prefix sum (two launches: zeros, cumsum; a uint8 mask
// counts its nonzero bytes, one more). `keep` holds a computed one alive through the launch.
const int64_t* positions_of(const c10::optional<at::Tensor>& positions, const at::Tensor& mask,
                            const at::Tensor& m8, at::Tensor& keep) {
  if (positions) return positions->data_ptr<int64_t>();
  const int64_t nb = m8.numel();
  keep = at::zeros({nb + 1}, m8.options().dtype(at::kLong));
  auto out = keep.narrow(0, 1, nb);
  at::cumsum_out(out, mask.scalar_type() == at::kBool ? m8 : m8.ne(0), 0, at::kLong);
  return keep.data_ptr<int64_t>();
}

std::tuple<at::Tensor, at::Tensor> score_blocks_cuda(const at::Tensor& grad,
                                                     const c10::optional<at::Tensor>& param, int64_t bs,
                                                     int64_t metric, double eps) {
  const auto [dt, w] = check_score(grad, param, bs, metric);
  auto guard = cuda_guard(grad, "grad");
  const int64_t n = grad.numel();
  auto scores = at::empty({num_blocks(n, bs)}, grad.options().dtype(at::kFloat));
  auto nonfinite = at::zeros({1}, grad.options().dtype(at::kInt));
  if (n == 0) return {scores, nonfinite};
  const int64_t ws = cuda::score_workspace(n, bs);
  auto workspace = at::empty({ws}, grad.options().dtype(at::kFloat));
  cuda::score_blocks(dt, grad.data_ptr(), w, n, bs, static_cast<Metric>(metric), float(eps),
                     scores.data_ptr<float>(), nonfinite.data_ptr<int32_t>(),
                     ws ? workspace.data_ptr<float>() : nullptr, stream_of(grad));
  return {scores, nonfinite};
}

void pack_blocks_cuda(const at::Tensor& flat, const at::Tensor& ids, int64_t bs, const at::Tensor& out) {
  const DType dt = check_flat(flat, bs);
  check_like(out, "out", flat, "flat", -1);
  int64_t short_pos;
  const int64_t len = validate_ids_cuda(ids, flat, bs, &short_pos);
  check_packed(flat, out, "out", len, /*into_flat=*/false);
  if (len == 0) return;
  auto guard = cuda_guard(flat, "flat");
  cuda::pack_blocks(dt, flat.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs, short_pos,
                    out.data_ptr(), stream_of(flat));
}

void unpack_blocks_cuda(const at::Tensor& buf, const at::Tensor& ids, int64_t bs, const at::Tensor& flat,
                        bool accumulate) {
  const DType dt = check_flat(flat, bs);
  check_like(buf, "buf", flat, "flat", -1);
  int64_t short_pos;
  const int64_t len = validate_ids_cuda(ids, flat, bs, &short_pos);
  check_packed(flat, buf, "buf", len, /*into_flat=*/true);
  if (len == 0) return;
  auto guard = cuda_guard(flat, "flat");
  cuda::unpack_blocks(dt, buf.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs, short_pos,
                      flat.data_ptr(), accumulate, stream_of(flat));
}

void split_blocks_cuda(const at::Tensor& flat, const at::Tensor& mask, int64_t bs,
                       const c10::optional<at::Tensor>& crit, const c10::optional<at::Tensor>& def,
                       const c10::optional<at::Tensor>& positions) {
  const auto m8 = check_split(flat, mask, bs, crit, def, positions, /*into_flat=*/false, unchecked_lengths);
  auto guard = cuda_guard(flat, "flat");
  if (flat.numel() == 0) return;
  at::Tensor keep;
  const int64_t* pos = positions_of(positions, mask, m8, keep);
  cuda::split_blocks(to_dtype(flat, "flat"), flat.data_ptr(), flat.numel(), m8.data_ptr<uint8_t>(), pos, bs,
                     data_or_null(crit), crit ? crit->numel() : 0, data_or_null(def), def ? def->numel() : 0,
                     stream_of(flat));
}

void merge_blocks_cuda(const c10::optional<at::Tensor>& crit, const c10::optional<at::Tensor>& def,
                       const at::Tensor& mask, int64_t bs, const at::Tensor& flat,
                       const c10::optional<at::Tensor>& positions) {
  const auto m8 = check_split(flat, mask, bs, crit, def, positions, /*into_flat=*/true, unchecked_lengths);
  auto guard = cuda_guard(flat, "flat");
  if (flat.numel() == 0) return;
  at::Tensor keep;
  const int64_t* pos = positions_of(positions, mask, m8, keep);
  cuda::merge_blocks(to_dtype(flat, "flat"), data_or_null(crit), crit ? crit->numel() : 0, data_or_null(def),
                     def ? def->numel() : 0, m8.data_ptr<uint8_t>(), pos, flat.numel(), bs, flat.data_ptr(),
                     stream_of(flat));
}

void sgd_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                   const c10::optional<at::Tensor>& momentum_buffer, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, bool maximize, bool first) {
  void* m = check_sgd(param, grad, momentum_buffer, momentum);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize, first};
  auto guard = cuda_guard(param, "param");
  if (param.numel() == 0) return;
  cuda::sgd_step(to_dtype(param, "param"), param.data_ptr(), grad.data_ptr(), m, param.numel(), h,
                 stream_of(param));
}

void sgd_step_into_cuda(const at::Tensor& param, const c10::optional<at::Tensor>& momentum_buffer,
                        const at::Tensor& snap_param, const c10::optional<at::Tensor>& snap_momentum,
                        const at::Tensor& grad, const at::Tensor& mask, int64_t bs, double lr, double momentum,
                        double dampening, double weight_decay, bool nesterov, bool maximize, bool first,
                        const c10::optional<at::Tensor>& positions) {
  const auto m8 = check_sgd_into(param, momentum_buffer, snap_param, snap_momentum, grad, mask, bs, momentum,
                                 first, positions, unchecked_lengths);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize, first};
  auto guard = cuda_guard(param, "param");
  if (param.numel() == 0) return;
  at::Tensor keep;
  const int64_t* pos = positions_of(positions, mask, m8, keep);
  int64_t packed_n = std::min(snap_param.numel(), grad.numel());
  if (momentum != 0.0 && !first) packed_n = std::min(packed_n, snap_momentum->numel());
  cuda::sgd_step_into(to_dtype(param, "param"), param.data_ptr(), momentum != 0.0 ? momentum_buffer->data_ptr()
                      : nullptr, snap_param.data_ptr(), data_or_null(snap_momentum), grad.data_ptr(),
                      m8.data_ptr<uint8_t>(), pos, param.numel(), bs, packed_n, h,
                      stream_of(param));
}

void adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& max_exp_avg_sq,
                    double step, double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool amsgrad, bool maximize, bool decoupled) {
  void* mx = check_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, amsgrad);
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, step, amsgrad, maximize, decoupled};
  auto guard = cuda_guard(param, "param");
  if (param.numel() == 0) return;
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

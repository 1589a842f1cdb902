// Input checks shared by the CPU and CUDA registrations: each names what was expected and what was
// got. Header-only, so each device's registration file compiles them in.
#pragma once
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <sstream>
#include <string>
#include <utility>

#include "ops.h"

namespace osp {
namespace checks {

inline DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default:
      TORCH_CHECK(false, "osp: ", name, " must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

inline void check_dense(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.layout() == at::kStrided, "osp: ", name, " must be a dense tensor, got layout ",
              t.layout());
  TORCH_CHECK(t.is_contiguous(), "osp: ", name, " must be contiguous, got strides ", t.strides(),
              " for sizes ", t.sizes());
}

// `other` must match `ref` in dtype and device (and numel when numel >= 0).
inline void check_like(const at::Tensor& other, const char* oname, const at::Tensor& ref,
                       const char* rname, int64_t numel) {
  check_dense(other, oname);
  TORCH_CHECK(other.device() == ref.device(), "osp: ", oname, " must be on ", ref.device(),
              " like ", rname, ", got ", other.device());
  TORCH_CHECK(other.scalar_type() == ref.scalar_type(), "osp: ", oname, " must be ",
              ref.scalar_type(), " like ", rname, ", got ", other.scalar_type());
  TORCH_CHECK(numel < 0 || other.numel() == numel, "osp: ", oname, " must have ", numel,
              " elements, got ", other.numel());
}

// An optional argument that this call does not read must still be on ref's device: a stray CUDA
// tensor would send a CPU call to the CUDA kernels (or the reverse) and fail there without a name.
inline void check_device(const c10::optional<at::Tensor>& t, const char* name, const at::Tensor& ref,
                         const char* rname) {
  TORCH_CHECK(!t || t->device() == ref.device(), "osp: ", name, " must be on ", ref.device(), " like ", rname,
              ", got ", t->device());
}

// An output must not share memory with an input: the kernels read and write in parallel.
inline void check_no_overlap(const at::Tensor& out, const char* oname, const at::Tensor& in,
                             const char* iname) {
  TORCH_CHECK(at::get_overlap_status(out, in) == at::MemOverlapStatus::No, "osp: ", oname,
              " must not overlap ", iname, " (they share memory); pass a separate buffer");
}

inline void check_block_size(int64_t bs) {
  TORCH_CHECK(bs > 0, "osp: block_size must be a positive integer, got ", bs);
}

// score_blocks: the gradient's dtype and the flat parameter (for 'relative'), or nullptr.
inline std::pair<DType, const void*> check_score(const at::Tensor& grad,
                                                 const c10::optional<at::Tensor>& param, int64_t bs,
                                                 int64_t metric) {
  check_dense(grad, "grad");
  const DType dt = to_dtype(grad, "grad");
  check_block_size(bs);
  TORCH_CHECK(metric >= 0 && metric <= 3,
              "osp: metric must be 0 (l2), 1 (l1), 2 (max) or 3 (relative), got ", metric);
  check_device(param, "param", grad, "grad");
  if (static_cast<Metric>(metric) != Metric::Relative) return {dt, nullptr};
  TORCH_CHECK(param.has_value(), "osp: metric 'relative' needs the flat parameter, got None");
  check_like(*param, "param", grad, "grad", grad.numel());
  return {dt, param->data_ptr()};
}

// block_ids: int64, 1-D, on the flat tensor's device, at most one per block. Their values are
// checked per device (validate_ids); returns the number of blocks.
inline int64_t check_ids_shape(const at::Tensor& ids, const at::Tensor& flat, int64_t bs) {
  check_dense(ids, "block_ids");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "osp: block_ids must be int64, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == 1, "osp: block_ids must be 1-D, got ", ids.dim(), "-D");
  TORCH_CHECK(ids.device() == flat.device(), "osp: block_ids must be on ", flat.device(),
              " like the flat tensor, got ", ids.device());
  const int64_t nb = num_blocks(flat.numel(), bs);
  TORCH_CHECK(ids.numel() <= nb, "osp: block_ids has ", ids.numel(), " entries but the flat tensor has only ",
              nb, " blocks of ", bs);
  return nb;
}

// pack/unpack: the flat tensor and block size; returns its dtype.
inline DType check_flat(const at::Tensor& flat, int64_t bs) {
  check_dense(flat, "flat");
  const DType dt = to_dtype(flat, "flat");
  check_block_size(bs);
  return dt;
}

// pack/unpack: the packed buffer `buf` (named bname) holds `len` elements like `flat`, apart from it.
inline void check_packed(const at::Tensor& flat, const at::Tensor& buf, const char* bname, int64_t len,
                         bool into_flat) {
  check_like(buf, bname, flat, "flat", len);
  if (into_flat) check_no_overlap(flat, "flat", buf, bname);
  else check_no_overlap(buf, bname, flat, "flat");
}

// The packed length of nids whole blocks, one of them the short last block when has_last (no nb * bs,
// which wraps for a huge bs).
inline int64_t packed_length(int64_t nids, int64_t nb, int64_t bs, int64_t n, bool has_last) {
  return has_last ? (nids - 1) * bs + (n - (nb - 1) * bs) : nids * bs;
}

inline at::Tensor as_mask(const at::Tensor& mask, const at::Tensor& flat, int64_t bs) {
  check_dense(mask, "mask");
  TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kByte,
              "osp: mask must be bool or uint8, got ", mask.scalar_type());
  const int64_t nb = num_blocks(flat.numel(), bs);
  TORCH_CHECK(mask.numel() == nb, "osp: mask must have one entry per block (", nb, "), got ",
              mask.numel());
  TORCH_CHECK(mask.device() == flat.device(), "osp: mask must be on ", flat.device(), ", got ",
              mask.device());
  // read as bytes without a conversion kernel: any nonzero byte selects its block (the kernels test
  // mask[b] != 0; whoever counts the selected blocks counts the nonzero ones)
  return mask.scalar_type() == at::kBool ? mask.view(at::kByte) : mask;
}

// split/merge/sgd_step_into: the optional positions, an int64 exclusive prefix sum of the mask
// (ops.mask_positions), or the slice of one matching a sliced mask: one entry per block, on flat's
// device. Returns its data, or nullptr when not given. Its values are the caller's to get right
// (the CPU checks them against the mask; the CUDA kernels skip a block whose position is impossible).
inline const int64_t* check_positions(const c10::optional<at::Tensor>& pos, const at::Tensor& mask,
                                      const at::Tensor& flat, const char* fname) {
  if (!pos) return nullptr;
  check_dense(*pos, "positions");
  TORCH_CHECK(pos->scalar_type() == at::kLong, "osp: positions must be int64, got ", pos->scalar_type());
  TORCH_CHECK(pos->dim() == 1 && pos->numel() == mask.numel(), "osp: positions must have one entry per block "
              "like the mask (", mask.numel(), "), got sizes ", pos->sizes());
  TORCH_CHECK(pos->device() == flat.device(), "osp: positions must be on ", flat.device(), " like ", fname,
              ", got ", pos->device());
  return pos->data_ptr<int64_t>();
}

// split/merge: the flat tensor, mask (returned as bytes, see as_mask), positions and the two packed
// buffers. `lens` are their expected lengths, or -1 where the caller takes the buffers' own lengths.
inline at::Tensor check_split(const at::Tensor& flat, const at::Tensor& mask, int64_t bs,
                              const c10::optional<at::Tensor>& crit, const c10::optional<at::Tensor>& def,
                              const c10::optional<at::Tensor>& positions, bool into_flat,
                              std::pair<int64_t, int64_t> (*lengths)(const at::Tensor&, int64_t, int64_t)) {
  check_dense(flat, "flat");
  to_dtype(flat, "flat");
  check_block_size(bs);
  auto m8 = as_mask(mask, flat, bs);
  check_positions(positions, m8, flat, "flat");
  const auto lens = lengths(m8, flat.numel(), bs);
  if (crit) {
    check_like(*crit, "critical", flat, "flat", lens.first);
    if (into_flat) check_no_overlap(flat, "flat", *crit, "critical");
    else check_no_overlap(*crit, "critical", flat, "flat");
  }
  if (def) {
    check_like(*def, "deferred", flat, "flat", lens.second);
    if (into_flat) check_no_overlap(flat, "flat", *def, "deferred");
    else check_no_overlap(*def, "deferred", flat, "flat");
  }
  if (!into_flat && crit && def) check_no_overlap(*crit, "critical", *def, "deferred");
  return m8;
}

inline void* data_or_null(const c10::optional<at::Tensor>& t) {
  return t && t->numel() ? t->data_ptr() : nullptr;
}

// sgd_step_: the momentum buffer's pointer, or nullptr without momentum.
inline void* check_sgd(const at::Tensor& param, const at::Tensor& grad,
                       const c10::optional<at::Tensor>& momentum_buffer, double momentum) {
  check_dense(param, "param");
  to_dtype(param, "param");
  check_like(grad, "grad", param, "param", param.numel());
  check_device(momentum_buffer, "momentum_buffer", param, "param");
  TORCH_CHECK(momentum == 0.0 || momentum_buffer.has_value(),
              "osp: sgd_step with momentum ", momentum, " needs a momentum_buffer, got None");
  if (momentum == 0.0) return nullptr;
  check_like(*momentum_buffer, "momentum_buffer", param, "param", param.numel());
  return momentum_buffer->data_ptr();
}

// sgd_step_into_: the mask (returned as bytes), positions and the packed inputs; `lengths` gives the
// deferred blocks' packed length (-1: unchecked here, as on a GPU, where the kernel bounds its reads).
inline at::Tensor check_sgd_into(const at::Tensor& param, const c10::optional<at::Tensor>& momentum_buffer,
                                 const at::Tensor& snap_param, const c10::optional<at::Tensor>& snap_momentum,
                                 const at::Tensor& grad, const at::Tensor& mask, int64_t bs, double momentum,
                                 bool first, const c10::optional<at::Tensor>& positions,
                                 std::pair<int64_t, int64_t> (*lengths)(const at::Tensor&, int64_t, int64_t)) {
  check_dense(param, "param");
  to_dtype(param, "param");
  check_block_size(bs);
  check_device(momentum_buffer, "momentum_buffer", param, "param");
  check_device(snap_momentum, "snap_momentum", param, "param");
  auto m8 = as_mask(mask, param, bs);
  check_positions(positions, m8, param, "param");
  const int64_t len = lengths(m8, param.numel(), bs).second;
  check_like(snap_param, "snap_param", param, "param", len);
  check_no_overlap(param, "param", snap_param, "snap_param");
  check_like(grad, "grad", param, "param", len);
  check_no_overlap(param, "param", grad, "grad");
  if (momentum == 0.0) return m8;
  TORCH_CHECK(momentum_buffer.has_value(), "osp: sgd_step_into with momentum ", momentum,
              " needs a momentum_buffer, got None");
  check_like(*momentum_buffer, "momentum_buffer", param, "param", param.numel());
  check_no_overlap(*momentum_buffer, "momentum_buffer", param, "param");
  if (first) return m8;
  TORCH_CHECK(snap_momentum.has_value(), "osp: sgd_step_into with momentum ", momentum,
              " after the first step needs snap_momentum, got None");
  check_like(*snap_momentum, "snap_momentum", param, "param", len);
  check_no_overlap(*momentum_buffer, "momentum_buffer", *snap_momentum, "snap_momentum");
  return m8;
}

// adam_step_: the max_exp_avg_sq pointer, or nullptr without amsgrad.
inline void* check_adam(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& max_exp_avg_sq,
                        double step, bool amsgrad) {
  check_dense(param, "param");
  to_dtype(param, "param");
  const int64_t n = param.numel();
  check_like(grad, "grad", param, "param", n);
  check_like(exp_avg, "exp_avg", param, "param", n);
  check_like(exp_avg_sq, "exp_avg_sq", param, "param", n);
  check_device(max_exp_avg_sq, "max_exp_avg_sq", param, "param");
  TORCH_CHECK(step >= 1.0, "osp: adam_step needs the step count after this step's increment (>= 1), got ",
              step);
  if (!amsgrad) return nullptr;
  TORCH_CHECK(max_exp_avg_sq.has_value(), "osp: adam_step with amsgrad needs max_exp_avg_sq, got None");
  check_like(*max_exp_avg_sq, "max_exp_avg_sq", param, "param", n);
  return max_exp_avg_sq->data_ptr();
}

}  // namespace checks
}  // namespace osp

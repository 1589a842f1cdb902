// Torch op registration for osp: schemas, input checks that name what was expected and what was
// got, and dispatch to the CPU kernels or (when built with CUDA) the CUDA launchers.
#include <Python.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#ifdef WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <string>
#include <vector>

#include "ops.h"

extern "C" {
// `import osp._C` loads this library, which registers the ops below with torch.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace osp {
namespace {

std::string str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << " tensor of " << t.numel() << " elements on " << t.device();
  return s.str();
}

DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default:
      TORCH_CHECK(false, "osp: ", name, " must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

void check_dense(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.layout() == at::kStrided, "osp: ", name, " must be a dense tensor, got layout ",
              t.layout());
  TORCH_CHECK(t.is_contiguous(), "osp: ", name, " must be contiguous, got strides ", t.strides(),
              " for sizes ", t.sizes());
  TORCH_CHECK(t.is_cpu() || t.is_cuda(), "osp: ", name, " must be on the CPU or a CUDA device, got ",
              t.device());
#ifndef WITH_CUDA
  TORCH_CHECK(!t.is_cuda(), "osp: ", name, " is on ", t.device(),
              " but osp._C was built without CUDA (rebuild with FORCE_CUDA=1 and nvcc on PATH)");
#endif
}

// `other` must match `ref` in dtype and device (and numel when numel >= 0).
void check_like(const at::Tensor& other, const char* oname, const at::Tensor& ref,
                const char* rname, int64_t numel) {
  check_dense(other, oname);
  TORCH_CHECK(other.device() == ref.device(), "osp: ", oname, " must be on ", ref.device(),
              " like ", rname, ", got ", other.device());
  TORCH_CHECK(other.scalar_type() == ref.scalar_type(), "osp: ", oname, " must be ",
              ref.scalar_type(), " like ", rname, ", got ", other.scalar_type());
  TORCH_CHECK(numel < 0 || other.numel() == numel, "osp: ", oname, " must have ", numel,
              " elements, got ", other.numel());
}

// An output must not share memory with an input: the kernels read and write in parallel.
void check_no_overlap(const at::Tensor& out, const char* oname, const at::Tensor& in, const char* iname) {
  TORCH_CHECK(at::get_overlap_status(out, in) == at::MemOverlapStatus::No, "osp: ", oname,
              " must not overlap ", iname, " (they share memory); pass a separate buffer");
}

void check_block_size(int64_t bs) {
  TORCH_CHECK(bs > 0, "osp: block_size must be a positive integer, got ", bs);
}

#ifdef WITH_CUDA
void* stream_of(const at::Tensor& t) { return at::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

// Checks ids (int64, 1-D, valid, distinct) and returns the packed length they select.
int64_t check_ids(const at::Tensor& ids, const at::Tensor& flat, int64_t bs) {
  check_dense(ids, "block_ids");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "osp: block_ids must be int64, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == 1, "osp: block_ids must be 1-D, got ", ids.dim(), "-D");
  TORCH_CHECK(ids.device() == flat.device(), "osp: block_ids must be on ", flat.device(),
              " like the flat tensor, got ", ids.device());
  const int64_t n = flat.numel(), nb = num_blocks(n, bs), nids = ids.numel();
  TORCH_CHECK(nids <= nb, "osp: block_ids has ", nids, " entries but the flat tensor has only ", nb,
              " blocks of ", bs);
  if (nids == 0) return 0;
  bool has_last = false;
  if (ids.is_cpu()) {
    std::vector<uint8_t> seen(nb, 0);
    const int64_t* p = ids.data_ptr<int64_t>();
    for (int64_t k = 0; k < nids; ++k) {
      TORCH_CHECK(p[k] >= 0 && p[k] < nb, "osp: block id ", p[k], " at position ", k,
                  " is out of range: expected 0 <= id < ", nb, " (", n, " elements in blocks of ", bs, ")");
      TORCH_CHECK(!seen[p[k]], "osp: block id ", p[k], " appears more than once in block_ids");
      seen[p[k]] = 1;
    }
    has_last = seen[nb - 1];
  } else {
#ifdef WITH_CUDA
    c10::cuda::CUDAGuard guard(ids.device());
    auto seen = at::zeros({nb}, ids.options().dtype(at::kInt));
    auto bad = at::zeros({1}, ids.options().dtype(at::kInt));
    cuda::check_ids(ids.data_ptr<int64_t>(), nids, nb, seen.data_ptr<int32_t>(),
                    bad.data_ptr<int32_t>(), stream_of(ids));
    const int32_t b = bad.item<int32_t>();
    TORCH_CHECK(!(b & 1), "osp: block_ids holds an id out of range: expected 0 <= id < ", nb,
                ", got min ", ids.min().item<int64_t>(), " and max ", ids.max().item<int64_t>());
    TORCH_CHECK(!(b & 2), "osp: block_ids holds an id more than once");
    has_last = seen[nb - 1].item<int32_t>() != 0;
#endif
  }
  const int64_t short_by = nb * bs - n;
  return nids * bs - (has_last ? short_by : 0);
}

#ifdef WITH_CUDA
// Position in ids of the short last block, or -1 (one device sync, only when n % bs != 0).
int64_t short_position(const at::Tensor& ids, int64_t n, int64_t bs) {
  if (n % bs == 0 || ids.numel() == 0) return -1;
  auto hit = (ids == num_blocks(n, bs) - 1).nonzero();
  return hit.numel() ? hit[0][0].item<int64_t>() : -1;
}
#endif

at::Tensor as_mask(const at::Tensor& mask, const at::Tensor& flat, int64_t bs) {
  check_dense(mask, "mask");
  TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kByte,
              "osp: mask must be bool or uint8, got ", mask.scalar_type());
  const int64_t nb = num_blocks(flat.numel(), bs);
  TORCH_CHECK(mask.numel() == nb, "osp: mask must have one entry per block (", nb, "), got ",
              mask.numel());
  TORCH_CHECK(mask.device() == flat.device(), "osp: mask must be on ", flat.device(), ", got ",
              mask.device());
  // any nonzero byte selects its block: normalise to 0/1, which the offsets (prefix sums) count
  return mask.scalar_type() == at::kBool ? mask.view(at::kByte) : mask.ne(0).view(at::kByte);
}

// Packed lengths of the selected (mask != 0) and other blocks, to check the outputs of split/merge.
// Only on the CPU: on a CUDA device they would cost a sync every call, so there the buffers' own
// lengths are taken as given (the caller knows them: osp's buffers hold whole blocks) and the kernels
// never write or read past them.
std::pair<int64_t, int64_t> side_lengths(const at::Tensor& m8, int64_t n, int64_t bs) {
  const int64_t nb = num_blocks(n, bs);
  if (nb == 0) return {0, 0};
  const int64_t sel = m8.sum().item<int64_t>();
  const bool last_sel = m8[nb - 1].item<uint8_t>() != 0;
  const int64_t short_by = nb * bs - n;
  return {sel * bs - (last_sel ? short_by : 0), (nb - sel) * bs - (last_sel ? 0 : short_by)};
}

std::tuple<at::Tensor, at::Tensor> score_blocks(const at::Tensor& grad,
                                                const c10::optional<at::Tensor>& param,
                                                int64_t bs, int64_t metric, double eps) {
  check_dense(grad, "grad");
  const DType dt = to_dtype(grad, "grad");
  check_block_size(bs);
  TORCH_CHECK(metric >= 0 && metric <= 3, "osp: metric must be 0 (l2), 1 (l1), 2 (max) or 3 (relative), got ", metric);
  const Metric m = static_cast<Metric>(metric);
  const void* w = nullptr;
  if (m == Metric::Relative) {
    TORCH_CHECK(param.has_value(), "osp: metric 'relative' needs the flat parameter, got None");
    check_like(*param, "param", grad, "grad", grad.numel());
    w = param->data_ptr();
  }
  const int64_t n = grad.numel();
  auto scores = at::empty({num_blocks(n, bs)}, grad.options().dtype(at::kFloat));
  auto nonfinite = at::zeros({1}, grad.options().dtype(at::kInt));
  if (n == 0) return {scores, nonfinite};
  if (grad.is_cpu()) {
    cpu::score_blocks(dt, grad.data_ptr(), w, n, bs, m, float(eps), scores.data_ptr<float>(),
                      nonfinite.data_ptr<int32_t>());
  } else {
#ifdef WITH_CUDA
    c10::cuda::CUDAGuard guard(grad.device());
    cuda::score_blocks(dt, grad.data_ptr(), w, n, bs, m, float(eps), scores.data_ptr<float>(),
                       nonfinite.data_ptr<int32_t>(), stream_of(grad));
#endif
  }
  return {scores, nonfinite};
}

void pack_blocks(const at::Tensor& flat, const at::Tensor& ids, int64_t bs, const at::Tensor& out) {
  check_dense(flat, "flat");
  const DType dt = to_dtype(flat, "flat");
  check_block_size(bs);
  const int64_t len = check_ids(ids, flat, bs);
  check_like(out, "out", flat, "flat", len);
  check_no_overlap(out, "out", flat, "flat");
  if (len == 0) return;
  if (flat.is_cpu()) {
    cpu::pack_blocks(dt, flat.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs,
                     out.data_ptr());
  } else {
#ifdef WITH_CUDA
    c10::cuda::CUDAGuard guard(flat.device());
    cuda::pack_blocks(dt, flat.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs,
                      short_position(ids, flat.numel(), bs), out.data_ptr(), stream_of(flat));
#endif
  }
}

void unpack_blocks(const at::Tensor& buf, const at::Tensor& ids, int64_t bs, const at::Tensor& flat,
                   bool accumulate) {
  check_dense(flat, "flat");
  const DType dt = to_dtype(flat, "flat");
  check_block_size(bs);
  const int64_t len = check_ids(ids, flat, bs);
  check_like(buf, "buf", flat, "flat", len);
  check_no_overlap(flat, "flat", buf, "buf");
  if (len == 0) return;
  if (flat.is_cpu()) {
    cpu::unpack_blocks(dt, buf.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs,
                       flat.data_ptr(), accumulate);
  } else {
#ifdef WITH_CUDA
    c10::cuda::CUDAGuard guard(flat.device());
    cuda::unpack_blocks(dt, buf.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs,
                        short_position(ids, flat.numel(), bs), flat.data_ptr(), accumulate,
                        stream_of(flat));
#endif
  }
}

void split_blocks(const at::Tensor& flat, const at::Tensor& mask, int64_t bs,
                  const c10::optional<at::Tensor>& crit, const c10::optional<at::Tensor>& def) {
  check_dense(flat, "flat");
  const DType dt = to_dtype(flat, "flat");
  check_block_size(bs);
  const auto m8 = as_mask(mask, flat, bs);
  const int64_t n = flat.numel();
  const bool cpu = flat.is_cpu();
  const auto lens = cpu ? side_lengths(m8, n, bs) : std::make_pair<int64_t, int64_t>(-1, -1);
  if (crit) { check_like(*crit, "critical", flat, "flat", lens.first); check_no_overlap(*crit, "critical", flat, "flat"); }
  if (def) { check_like(*def, "deferred", flat, "flat", lens.second); check_no_overlap(*def, "deferred", flat, "flat"); }
  if (crit && def) check_no_overlap(*crit, "critical", *def, "deferred");
  void* c = crit && crit->numel() ? crit->data_ptr() : nullptr;
  void* d = def && def->numel() ? def->data_ptr() : nullptr;
  if (n == 0) return;
  if (flat.is_cpu()) {
    cpu::split_blocks(dt, flat.data_ptr(), n, m8.data_ptr<uint8_t>(), bs, c, d);
  } else {
#ifdef WITH_CUDA
    c10::cuda::CUDAGuard guard(flat.device());
    auto pos = m8.cumsum(0, at::kLong) - m8.to(at::kLong);
    cuda::split_blocks(dt, flat.data_ptr(), n, m8.data_ptr<uint8_t>(), pos.data_ptr<int64_t>(), bs,
                       c, crit ? crit->numel() : 0, d, def ? def->numel() : 0, stream_of(flat));
#endif
  }
}

void merge_blocks(const c10::optional<at::Tensor>& crit, const c10::optional<at::Tensor>& def,
                  const at::Tensor& mask, int64_t bs, const at::Tensor& flat) {
  check_dense(flat, "flat");
  const DType dt = to_dtype(flat, "flat");
  check_block_size(bs);
  const auto m8 = as_mask(mask, flat, bs);
  const int64_t n = flat.numel();
  const bool cpu = flat.is_cpu();
  const auto lens = cpu ? side_lengths(m8, n, bs) : std::make_pair<int64_t, int64_t>(-1, -1);
  if (crit) { check_like(*crit, "critical", flat, "flat", lens.first); check_no_overlap(flat, "flat", *crit, "critical"); }
  if (def) { check_like(*def, "deferred", flat, "flat", lens.second); check_no_overlap(flat, "flat", *def, "deferred"); }
  const void* c = crit && crit->numel() ? crit->data_ptr() : nullptr;
  const void* d = def && def->numel() ? def->data_ptr() : nullptr;
  if (n == 0) return;
  if (flat.is_cpu()) {
    cpu::merge_blocks(dt, c, d, m8.data_ptr<uint8_t>(), n, bs, flat.data_ptr());
  } else {
#ifdef WITH_CUDA
    c10::cuda::CUDAGuard guard(flat.device());
    auto pos = m8.cumsum(0, at::kLong) - m8.to(at::kLong);
    cuda::merge_blocks(dt, c, crit ? crit->numel() : 0, d, def ? def->numel() : 0, m8.data_ptr<uint8_t>(),
                       pos.data_ptr<int64_t>(), n, bs, flat.data_ptr(), stream_of(flat));
#endif
  }
}

void sgd_step(const at::Tensor& param, const at::Tensor& grad,
              const c10::optional<at::Tensor>& momentum_buffer, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool maximize, bool first) {
  check_dense(param, "param");
  const DType dt = to_dtype(param, "param");
  check_like(grad, "grad", param, "param", param.numel());
  TORCH_CHECK(momentum == 0.0 || momentum_buffer.has_value(),
              "osp: sgd_step with momentum ", momentum, " needs a momentum_buffer, got None");
  void* m = nullptr;
  if (momentum != 0.0) {
    check_like(*momentum_buffer, "momentum_buffer", param, "param", param.numel());
    m = momentum_buffer->data_ptr();
  }
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize, first};
  if (param.numel() == 0) return;
  if (param.is_cpu()) {
    cpu::sgd_step(dt, param.data_ptr(), grad.data_ptr(), m, param.numel(), h);
  } else {
#ifdef WITH_CUDA
    c10::cuda::CUDAGuard guard(param.device());
    cuda::sgd_step(dt, param.data_ptr(), grad.data_ptr(), m, param.numel(), h, stream_of(param));
#endif
  }
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& max_exp_avg_sq,
               double step, double lr, double beta1, double beta2, double eps, double weight_decay,
               bool amsgrad, bool maximize, bool decoupled) {
  check_dense(param, "param");
  const DType dt = to_dtype(param, "param");
  const int64_t n = param.numel();
  check_like(grad, "grad", param, "param", n);
  check_like(exp_avg, "exp_avg", param, "param", n);
  check_like(exp_avg_sq, "exp_avg_sq", param, "param", n);
  TORCH_CHECK(step >= 1.0, "osp: adam_step needs the step count after this step's increment (>= 1), got ", step);
  void* mx = nullptr;
  if (amsgrad) {
    TORCH_CHECK(max_exp_avg_sq.has_value(), "osp: adam_step with amsgrad needs max_exp_avg_sq, got None");
    check_like(*max_exp_avg_sq, "max_exp_avg_sq", param, "param", n);
    mx = max_exp_avg_sq->data_ptr();
  }
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, step, amsgrad, maximize, decoupled};
  if (n == 0) return;
  if (param.is_cpu()) {
    cpu::adam_step(dt, param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                   mx, n, h);
  } else {
#ifdef WITH_CUDA
    c10::cuda::CUDAGuard guard(param.device());
    cuda::adam_step(dt, param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                    mx, n, h, stream_of(param));
#endif
  }
}

}  // namespace

TORCH_LIBRARY(osp, m) {
  m.def("score_blocks(Tensor grad, Tensor? param, int block_size, int metric, float eps) -> (Tensor, Tensor)");
  m.def("pack_blocks(Tensor flat, Tensor block_ids, int block_size, Tensor(a!) out) -> ()");
  m.def("unpack_blocks(Tensor buf, Tensor block_ids, int block_size, Tensor(a!) flat, bool accumulate=False) -> ()");
  m.def("split_blocks(Tensor flat, Tensor mask, int block_size, Tensor(a!)? critical, Tensor(b!)? deferred) -> ()");
  m.def("merge_blocks(Tensor? critical, Tensor? deferred, Tensor mask, int block_size, Tensor(a!) flat) -> ()");
  m.def("sgd_step_(Tensor(a!) param, Tensor grad, Tensor(b!)? momentum_buffer, float lr, float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, bool first) -> ()");
  m.def("adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? max_exp_avg_sq, float step, float lr, float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, bool decoupled) -> ()");
}

// One implementation per op serves both devices: it checks its inputs, then dispatches on the
// tensors' device (mixed devices are refused by the checks).
#define OSP_IMPLS(m)                         \
  m.impl("score_blocks", &score_blocks);     \
  m.impl("pack_blocks", &pack_blocks);       \
  m.impl("unpack_blocks", &unpack_blocks);   \
  m.impl("split_blocks", &split_blocks);     \
  m.impl("merge_blocks", &merge_blocks);     \
  m.impl("sgd_step_", &sgd_step);            \
  m.impl("adam_step_", &adam_step);

TORCH_LIBRARY_IMPL(osp, CPU, m) { OSP_IMPLS(m) }
#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(osp, CUDA, m) { OSP_IMPLS(m) }
#endif

}  // namespace osp

// Torch op registration for osp: the schemas, and the CPU implementations (input checks from
// checks.h, then the CPU kernels). The CUDA implementations register themselves in
// cuda/bindings_cuda.cpp, built only with CUDA. launch_shape / launch_items / launch_cover expose the
// CUDA kernels' launch arithmetic (launch.h) on any build, for tests without a GPU.
#include <Python.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/ops/sqrt_cpu_dispatch.h>

#include <algorithm>
#include <vector>

#include "checks.h"
#include "launch.h"
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
using namespace checks;

// Validates the ids' values (in range, distinct); returns the packed length they select.
int64_t validate_ids_cpu(const at::Tensor& ids, const at::Tensor& flat, int64_t bs) {
  const int64_t nb = check_ids_shape(ids, flat, bs), n = flat.numel(), nids = ids.numel();
  if (nids == 0) return 0;
  std::vector<uint8_t> seen(nb, 0);
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t k = 0; k < nids; ++k) {
    TORCH_CHECK(p[k] >= 0 && p[k] < nb, "osp: block id ", p[k], " at position ", k,
                " is out of range: expected 0 <= id < ", nb, " (", n, " elements in blocks of ", bs, ")");
    TORCH_CHECK(!seen[p[k]], "osp: block id ", p[k], " appears more than once in block_ids");
    seen[p[k]] = 1;
  }
  return packed_length(nids, nb, bs, n, seen[nb - 1]);
}

// Packed lengths of the selected (mask != 0) and other blocks, to check split/merge buffers.
std::pair<int64_t, int64_t> side_lengths(const at::Tensor& m8, int64_t n, int64_t bs) {
  const int64_t nb = num_blocks(n, bs);
  if (nb == 0) return {0, 0};
  const uint8_t* m = m8.data_ptr<uint8_t>();
  int64_t sel = 0;
  for (int64_t b = 0; b < nb; ++b) sel += m[b] != 0;
  const bool last_sel = m[nb - 1] != 0;
  return {packed_length(sel, nb, bs, n, last_sel), packed_length(nb - sel, nb, bs, n, !last_sel)};
}

// The CPU kernels find the blocks' places themselves; given positions must still be what the CUDA
// kernels would read (pos[b] - pos[0] selected blocks before b), so a caller's slicing bug shows here.
void check_positions_cpu(const c10::optional<at::Tensor>& positions, const at::Tensor& m8) {
  if (!positions || m8.numel() == 0) return;
  const int64_t* p = positions->data_ptr<int64_t>();
  const uint8_t* m = m8.data_ptr<uint8_t>();
  int64_t sel = 0;
  for (int64_t b = 0; b < m8.numel(); ++b) {
    TORCH_CHECK(p[b] - p[0] == sel, "osp: positions do not match the mask: ", sel, " blocks are selected before "
                "block ", b, ", positions say ", p[b] - p[0], " (pass ops.mask_positions(mask), sliced like the mask)");
    sel += m[b] != 0;
  }
}

std::tuple<at::Tensor, at::Tensor> score_blocks_cpu(const at::Tensor& grad,
                                                    const c10::optional<at::Tensor>& param, int64_t bs,
                                                    int64_t metric, double eps) {
  const auto [dt, w] = check_score(grad, param, bs, metric);
  const int64_t n = grad.numel();
  auto scores = at::empty({num_blocks(n, bs)}, grad.options().dtype(at::kFloat));
  auto nonfinite = at::zeros({1}, grad.options().dtype(at::kInt));
  if (n > 0)
    cpu::score_blocks(dt, grad.data_ptr(), w, n, bs, static_cast<Metric>(metric), float(eps),
                      scores.data_ptr<float>(), nonfinite.data_ptr<int32_t>());
  return {scores, nonfinite};
}

void pack_blocks_cpu(const at::Tensor& flat, const at::Tensor& ids, int64_t bs, const at::Tensor& out) {
  const DType dt = check_flat(flat, bs);
  check_like(out, "out", flat, "flat", -1);
  const int64_t len = validate_ids_cpu(ids, flat, bs);
  check_packed(flat, out, "out", len, /*into_flat=*/false);
  if (len > 0)
    cpu::pack_blocks(dt, flat.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs,
                     out.data_ptr());
}

void unpack_blocks_cpu(const at::Tensor& buf, const at::Tensor& ids, int64_t bs, const at::Tensor& flat,
                       bool accumulate) {
  const DType dt = check_flat(flat, bs);
  check_like(buf, "buf", flat, "flat", -1);
  const int64_t len = validate_ids_cpu(ids, flat, bs);
  check_packed(flat, buf, "buf", len, /*into_flat=*/true);
  if (len > 0)
    cpu::unpack_blocks(dt, buf.data_ptr(), flat.numel(), ids.data_ptr<int64_t>(), ids.numel(), bs,
                       flat.data_ptr(), accumulate);
}

void split_blocks_cpu(const at::Tensor& flat, const at::Tensor& mask, int64_t bs,
                      const c10::optional<at::Tensor>& crit, const c10::optional<at::Tensor>& def,
                      const c10::optional<at::Tensor>& positions) {
  const auto m8 = check_split(flat, mask, bs, crit, def, positions, /*into_flat=*/false, side_lengths);
  check_positions_cpu(positions, m8);
  if (flat.numel() > 0)
    cpu::split_blocks(to_dtype(flat, "flat"), flat.data_ptr(), flat.numel(), m8.data_ptr<uint8_t>(), bs,
                      data_or_null(crit), data_or_null(def));
}

void merge_blocks_cpu(const c10::optional<at::Tensor>& crit, const c10::optional<at::Tensor>& def,
                      const at::Tensor& mask, int64_t bs, const at::Tensor& flat,
                      const c10::optional<at::Tensor>& positions) {
  const auto m8 = check_split(flat, mask, bs, crit, def, positions, /*into_flat=*/true, side_lengths);
  check_positions_cpu(positions, m8);
  if (flat.numel() > 0)
    cpu::merge_blocks(to_dtype(flat, "flat"), data_or_null(crit), data_or_null(def), m8.data_ptr<uint8_t>(),
                      flat.numel(), bs, flat.data_ptr());
}

void sgd_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                  const c10::optional<at::Tensor>& momentum_buffer, double lr, double momentum,
                  double dampening, double weight_decay, bool nesterov, bool maximize, bool first) {
  void* m = check_sgd(param, grad, momentum_buffer, momentum);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize, first};
  if (param.numel() > 0)
    cpu::sgd_step(to_dtype(param, "param"), param.data_ptr(), grad.data_ptr(), m, param.numel(), h);
}

void sgd_step_into_cpu(const at::Tensor& param, const c10::optional<at::Tensor>& momentum_buffer,
                       const at::Tensor& snap_param, const c10::optional<at::Tensor>& snap_momentum,
                       const at::Tensor& grad, const at::Tensor& mask, int64_t bs, double lr, double momentum,
                       double dampening, double weight_decay, bool nesterov, bool maximize, bool first,
                       const c10::optional<at::Tensor>& positions) {
  const auto m8 = check_sgd_into(param, momentum_buffer, snap_param, snap_momentum, grad, mask, bs, momentum,
                                 first, positions, side_lengths);
  check_positions_cpu(positions, m8);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize, first};
  if (param.numel() > 0)
    cpu::sgd_step_into(to_dtype(param, "param"), param.data_ptr(), momentum != 0.0 ? momentum_buffer->data_ptr()
                       : nullptr, snap_param.data_ptr(), data_or_null(snap_momentum), grad.data_ptr(),
                       m8.data_ptr<uint8_t>(), param.numel(), bs, h);
}

// torch's own fp32 sqrt on raw buffers (cpu::adam_step's SqrtF32): the CPU kernel at::cpu::sqrt_out
// calls, without the dispatcher, from inside the Adam kernel's parallel loop (where torch's own loops
// run serially). It is an elementwise function of the value, whatever the piece or its alignment: MKL's
// VML sqrt where torch has MKL (not correctly rounded), a vector sqrt otherwise.
void torch_sqrt_f32(float* out, const float* in, int64_t n) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  at::Tensor o = at::from_blob(out, {n}, opts);
  at::cpu::sqrt_out(o, at::from_blob(const_cast<float*>(in), {n}, opts));
}

void adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& max_exp_avg_sq,
                   double step, double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool amsgrad, bool maximize, bool decoupled) {
  void* mx = check_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, amsgrad);
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, step, amsgrad, maximize, decoupled};
  if (param.numel() > 0)
    cpu::adam_step(to_dtype(param, "param"), param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                   exp_avg_sq.data_ptr(), mx, param.numel(), h, &torch_sqrt_f32);
}

// [rows, span, chunk, chunks, items, ctas, grid, group, per_cta] of score_plan's pass 1 (the shape of
// every block kernel), the workspace, then the same nine of pass 2 (zeros for one pass).
std::vector<int64_t> launch_shape(int64_t n, int64_t bs) {
  TORCH_CHECK(n >= 0, "osp: launch_shape needs n >= 0, got ", n);
  check_block_size(bs);
  const launch::ScorePlan p = launch::score_plan(n, bs);
  std::vector<int64_t> out;
  for (const launch::Shape* s : {&p.pass1, &p.pass2}) {
    out.insert(out.end(), {s->rows, s->span, s->chunk, s->chunks, s->items, s->ctas, s->grid, s->group, s->per_cta});
    if (s == &p.pass1) out.push_back(p.workspace);
  }
  return out;
}

// Items [first, first + count) of the block kernels as [block, chunk, begin, end): the flat elements
// the item covers (begin == end for a chunk past a short block's end).
at::Tensor launch_items(int64_t n, int64_t bs, int64_t first, int64_t count) {
  TORCH_CHECK(n >= 0 && first >= 0 && count >= 0, "osp: launch_items needs n, first, count >= 0");
  check_block_size(bs);
  const launch::Shape s = launch::shape(n, bs);
  const int64_t lo = std::min(first, s.items), hi = std::min(s.items, lo + std::min(count, s.items - lo));
  auto out = at::empty({hi - lo, 4}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t q = lo; q < hi; ++q, o += 4) {
    const launch::Item it = launch::item_at(s, q);
    const int64_t len = launch::block_len(it.row, n, bs), start = it.row * bs;
    o[0] = it.row;
    o[1] = it.chunk;
    o[2] = start + std::min(it.lo, len);
    o[3] = start + std::max(std::min(it.lo, len), launch::item_end(s, it, len));
  }
  return out;
}

// How often the kernels' loops (every CTA of the grid striding over the CTAs' work, every thread's
// slot and lane) visit each element: of the flat tensor (pass 1, the shape of every block kernel),
// or with reduce of score_blocks' workspace (pass 2; empty for one pass). Small sizes only.
at::Tensor launch_cover(int64_t n, int64_t bs, bool reduce) {
  TORCH_CHECK(n >= 0 && n <= (int64_t(1) << 24), "osp: launch_cover simulates every thread: n must be in [0, 2**24], got ", n);
  check_block_size(bs);
  const launch::ScorePlan p = launch::score_plan(n, bs);
  const launch::Shape& s = reduce ? p.pass2 : p.pass1;
  const int64_t size = reduce ? p.workspace : n, per_row = p.pass1.chunks;
  auto hits = at::zeros({size}, at::kInt);
  int32_t* h = hits.data_ptr<int32_t>();
  for (int64_t cta0 = 0; cta0 < s.grid; ++cta0)
    for (int64_t cta = cta0; cta < s.ctas; cta += s.grid)
      for (int t = 0; t < launch::kThreads; ++t) {
        const int slot = t / s.group, lane = t & (s.group - 1);
        const int64_t q = launch::item_index(s, cta, slot);
        if (q >= s.items) continue;
        const launch::Item it = launch::item_at(s, q);
        const int64_t start = reduce ? it.row * per_row : it.row * bs;
        const int64_t len = reduce ? per_row : launch::block_len(it.row, n, bs);
        for (int64_t i = it.lo + lane; i < launch::item_end(s, it, len); i += s.group) {
          TORCH_CHECK(start + i >= 0 && start + i < size, "osp: launch_cover: item ", q, " reaches element ",
                      start + i, " of ", size);
          ++h[start + i];
        }
      }
  return hits;
}

}  // namespace

TORCH_LIBRARY(osp, m) {
  m.def("score_blocks(Tensor grad, Tensor? param, int block_size, int metric, float eps) -> (Tensor, Tensor)");
  m.def("pack_blocks(Tensor flat, Tensor block_ids, int block_size, Tensor(a!) out) -> ()");
  m.def("unpack_blocks(Tensor buf, Tensor block_ids, int block_size, Tensor(a!) flat, bool accumulate=False) -> ()");
  m.def("split_blocks(Tensor flat, Tensor mask, int block_size, Tensor(a!)? critical, Tensor(b!)? deferred, Tensor? positions=None) -> ()");
  m.def("merge_blocks(Tensor? critical, Tensor? deferred, Tensor mask, int block_size, Tensor(a!) flat, Tensor? positions=None) -> ()");
  m.def("sgd_step_(Tensor(a!) param, Tensor grad, Tensor(b!)? momentum_buffer, float lr, float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, bool first) -> ()");
  m.def("sgd_step_into_(Tensor(a!) param, Tensor(b!)? momentum_buffer, Tensor snap_param, Tensor? snap_momentum, Tensor grad, Tensor mask, int block_size, float lr, float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, bool first, Tensor? positions=None) -> ()");
  m.def("adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? max_exp_avg_sq, float step, float lr, float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, bool decoupled) -> ()");
  // no tensor arguments: one kernel for every backend
  m.def("launch_shape(int n, int block_size) -> int[]", &launch_shape);
  m.def("launch_items(int n, int block_size, int first, int count) -> Tensor", &launch_items);
  m.def("launch_cover(int n, int block_size, bool reduce=False) -> Tensor", &launch_cover);
}

TORCH_LIBRARY_IMPL(osp, CPU, m) {
  m.impl("score_blocks", &score_blocks_cpu);
  m.impl("pack_blocks", &pack_blocks_cpu);
  m.impl("unpack_blocks", &unpack_blocks_cpu);
  m.impl("split_blocks", &split_blocks_cpu);
  m.impl("merge_blocks", &merge_blocks_cpu);
  m.impl("sgd_step_", &sgd_step_cpu);
  m.impl("sgd_step_into_", &sgd_step_into_cpu);
  m.impl("adam_step_", &adam_step_cpu);
}

}  // namespace osp

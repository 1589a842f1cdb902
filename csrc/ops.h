// Kernel contracts of osp: raw pointers and sizes only, no torch types, so that csrc/cuda compiles
// with nvcc alone. Sizes and indices are int64_t: a flat gradient can exceed 2^31 elements.
//
// Layout: a flat tensor of n elements is cut into nblocks = ceil(n / bs) blocks of bs elements; the
// last block holds n - (nblocks - 1) * bs elements. A packed buffer is the concatenation of the
// selected blocks, each with its true length, in the order given (ids) or in ascending block order
// (mask).
#pragma once
#include <cstdint>

namespace osp {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };
enum class Metric : int { L2 = 0, L1 = 1, Max = 2, Relative = 3 };

// The hyper-parameters of one torch.optim.SGD step, as torch.optim reads them.
struct SgdHyper {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;
  bool first;  // the momentum buffer did not exist before this step: it starts as the gradient
};

// One torch.optim.Adam / AdamW step; `step` is the step count after this step's increment.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay, step;
  bool amsgrad, maximize, decoupled;  // decoupled: AdamW's weight decay
};

// (n - 1) / bs + 1 rather than (n + bs - 1) / bs: no overflow for any positive bs.
inline int64_t num_blocks(int64_t n, int64_t bs) { return n == 0 ? 0 : (n - 1) / bs + 1; }

namespace cpu {
// scores[b] = metric over block b, accumulated in fp32; *nonfinite = 1 when any element of g is
// inf or nan (left untouched otherwise). w is read only for Metric::Relative.
void score_blocks(DType dt, const void* g, const void* w, int64_t n, int64_t bs, Metric m,
                  float eps, float* scores, int32_t* nonfinite);
// out = concat(flat[block ids[k]] for k); ids must be valid and distinct (checked by the caller).
void pack_blocks(DType dt, const void* flat, int64_t n, const int64_t* ids, int64_t nids,
                 int64_t bs, void* out);
// flat[block ids[k]] (=|+=) buf[k-th block]
void unpack_blocks(DType dt, const void* buf, int64_t n, const int64_t* ids, int64_t nids,
                   int64_t bs, void* flat, bool accumulate);
// One pass over flat: blocks with mask[b] != 0 go to crit, the others to def, each in ascending
// block order. Either output may be null (that side is skipped).
void split_blocks(DType dt, const void* flat, int64_t n, const uint8_t* mask, int64_t bs,
                  void* crit, void* def);
// The inverse of split_blocks: writes flat from crit (mask != 0) and def (mask == 0); a null side
// leaves those blocks of flat untouched.
void merge_blocks(DType dt, const void* crit, const void* def, const uint8_t* mask, int64_t n,
                  int64_t bs, void* flat);
// Exact optimizer steps on packed (contiguous) buffers, in place on param and state.
void sgd_step(DType dt, void* param, const void* grad, void* momentum_buf, int64_t n,
              const SgdHyper& h);
// out[i] = sqrt(in[i]) for n fp32 values, as torch computes it on the CPU (Adam's denominator): where
// torch is built with MKL that is MKL's VML sqrt, which is not correctly rounded (std::sqrt is) and
// differs from it by one ulp in about one element in 150. Called from inside the kernel's parallel loop
// on pieces of a few thousand elements; out and in do not overlap.
using SqrtF32 = void (*)(float* out, const float* in, int64_t n);
// In fp32 the denominator's square root comes from sqrt_f32 (bitwise torch.optim); in fp16/bf16 torch's
// own sqrt is correctly rounded in fp32 before rounding to the dtype, as std::sqrt is.
void adam_step(DType dt, void* param, const void* grad, void* exp_avg, void* exp_avg_sq,
               void* max_exp_avg_sq, int64_t n, const AdamHyper& h, SqrtF32 sqrt_f32);
// The SGD step of the blocks with mask[b] == 0 of a flat param (n elements, blocks of bs) from packed
// inputs: snap_param, snap_momentum (not read on the first step) and grad hold just those blocks, in
// ascending block order. The results go to the blocks' places in param and momentum_buf (null without
// momentum); the other blocks and the packed inputs are left as they are. Bitwise what sgd_step on the
// packed buffers followed by merge_blocks into param and momentum_buf gives.
void sgd_step_into(DType dt, void* param, void* momentum_buf, const void* snap_param,
                   const void* snap_momentum, const void* grad, const uint8_t* mask, int64_t n, int64_t bs,
                   const SgdHyper& h);
}  // namespace cpu

namespace cuda {
// The same contracts on device pointers, launched on `stream` (a cudaStream_t). Every launch is
// checked; a failure throws std::runtime_error with CUDA's message. `nonfinite` and `scores` are
// device pointers. The block kernels run over the launch shape of launch.h: a grid over (block, chunk)
// items from the host's block count (num_blocks), so one huge block spreads over many CTAs and small
// blocks share a CTA, a thread group each. For pack/unpack, short_pos is the position in ids of the
// short last block (or -1). For split/merge/sgd_step_into, pos is an exclusive prefix sum of a mask
// (int64), possibly a slice of a longer one: the blocks selected before b are pos[b] - pos[0] (read on
// the device); crit_n / def_n / packed_n are the buffers' lengths (a block reaching past one, or with
// an impossible position, is skipped: writes past them are dropped, never made).
//
// score_blocks folds each block in a fixed order that depends on (n, bs) only (launch::score_plan):
// the same bits on every run and rank, max exactly the CPU's, sums possibly not the CPU's last bits.
// workspace: score_workspace(n, bs) floats of device memory (0: none needed, may be null).
int64_t score_workspace(int64_t n, int64_t bs);
void score_blocks(DType dt, const void* g, const void* w, int64_t n, int64_t bs, Metric m,
                  float eps, float* scores, int32_t* nonfinite, float* workspace, void* stream);
void pack_blocks(DType dt, const void* flat, int64_t n, const int64_t* ids, int64_t nids,
                 int64_t bs, int64_t short_pos, void* out, void* stream);
void unpack_blocks(DType dt, const void* buf, int64_t n, const int64_t* ids, int64_t nids,
                   int64_t bs, int64_t short_pos, void* flat, bool accumulate, void* stream);
// Validates ids in one small kernel: info (check_ids_words(nblocks) int64 zeros) gets info[0] = bit 1
// an id out of range, bit 2 an id repeated; info[1] = 1 + the position in ids of the last block (0:
// not listed); the rest is scratch (a bitmap of the blocks seen). The host reads info[0..1] once.
int64_t check_ids_words(int64_t nblocks);
void check_ids(const int64_t* ids, int64_t nids, int64_t nblocks, int64_t* info, void* stream);
void split_blocks(DType dt, const void* flat, int64_t n, const uint8_t* mask, const int64_t* pos,
                  int64_t bs, void* crit, int64_t crit_n, void* def, int64_t def_n, void* stream);
void merge_blocks(DType dt, const void* crit, int64_t crit_n, const void* def, int64_t def_n,
                  const uint8_t* mask, const int64_t* pos, int64_t n, int64_t bs, void* flat,
                  void* stream);
void sgd_step(DType dt, void* param, const void* grad, void* momentum_buf, int64_t n,
              const SgdHyper& h, void* stream);
void adam_step(DType dt, void* param, const void* grad, void* exp_avg, void* exp_avg_sq,
               void* max_exp_avg_sq, int64_t n, const AdamHyper& h, void* stream);
// packed_n: the packed inputs' length (a block reaching past it is skipped, never read).
void sgd_step_into(DType dt, void* param, void* momentum_buf, const void* snap_param,
                   const void* snap_momentum, const void* grad, const uint8_t* mask, const int64_t* pos,
                   int64_t n, int64_t bs, int64_t packed_n, const SgdHyper& h, void* stream);
}  // namespace cuda

}  // namespace osp

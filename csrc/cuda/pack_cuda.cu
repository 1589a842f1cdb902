// Gather and scatter of whole blocks on the GPU over the launch shape of ../launch.h: a grid over
// (block, chunk) items, so one huge block spreads over many CTAs and small blocks share one (a thread
// group per block). Block counts come from the host (num_blocks, overflow-safe), never recomputed here.
//
// split/merge/sgd_step_into take pos, the exclusive prefix sum of a mask, possibly a slice of a longer
// one: the blocks selected before block b are pos[b] - pos[0] (pos[0] read here, no host sync). A
// position that cannot belong to this mask (outside [0, b]) and a block reaching past its buffer are
// skipped, never written. pack/unpack validate their ids with one small kernel (check_ids) whose
// result the host reads once.
#include "common_cuda.cuh"

namespace osp {
namespace cuda {
namespace {

using launch::Item;
using launch::Shape;

// Offset of the k-th listed block in the packed buffer; only the last block of flat is short, and the
// blocks listed after it start last_len rather than bs later.
__device__ __forceinline__ int64_t packed_offset(int64_t k, int64_t bs, int64_t short_pos, int64_t last_len) {
  return (short_pos >= 0 && k > short_pos) ? (k - 1) * bs + last_len : k * bs;
}

template <typename T, bool Pack>
__global__ void __launch_bounds__(kThreads) gather_kernel(const Shape s, const T* __restrict__ src, T* __restrict__ dst,
                                                          int64_t n, const int64_t* __restrict__ ids, int64_t bs,
                                                          int64_t short_pos, int64_t last_len, bool accumulate) {
  const int slot = threadIdx.x / s.group, lane = threadIdx.x & (s.group - 1);
  for (int64_t cta = blockIdx.x; cta < s.ctas; cta += gridDim.x) {
    const int64_t q = launch::item_index(s, cta, slot);
    if (q >= s.items) continue;
    const Item it = launch::item_at(s, q);
    const int64_t b = ids[it.row], len = block_len(b, n, bs), hi = launch::item_end(s, it, len);
    const int64_t f = b * bs, o = packed_offset(it.row, bs, short_pos, last_len);
    for (int64_t i = it.lo + lane; i < hi; i += s.group) {
      if constexpr (Pack) dst[o + i] = src[f + i];
      else dst[f + i] = accumulate ? from_f<T>(to_f(dst[f + i]) + to_f(src[o + i])) : src[o + i];
    }
  }
}

// info[0]: bit 1 an id out of range, bit 2 an id repeated; info[1]: 1 + the position in ids of the
// last block (0: not listed); info[2..]: a bitmap of the blocks seen (zeros on entry).
__global__ void check_ids_kernel(const int64_t* __restrict__ ids, int64_t nids, int64_t nb,
                                 unsigned long long* info) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < nids;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = ids[k];
    if (b < 0 || b >= nb) {
      atomicOr(info, 1ull);
      continue;
    }
    const unsigned long long bit = 1ull << (b & 63);
    if (atomicOr(info + 2 + (b >> 6), bit) & bit) atomicOr(info, 2ull);
    if (b == nb - 1) atomicMax(info + 1, static_cast<unsigned long long>(k + 1));
  }
}

// The blocks selected before b, from a mask's (possibly sliced) exclusive prefix sum; -1: impossible.
__device__ __forceinline__ int64_t before(const int64_t* __restrict__ pos, int64_t p0, int64_t b) {
  const int64_t r = pos[b] - p0;
  return (r < 0 || r > b) ? -1 : r;
}

template <typename T, bool Split>
__global__ void __launch_bounds__(kThreads) split_kernel(const Shape s, T* flat, int64_t n, int64_t bs,
                                                         const uint8_t* __restrict__ mask,
                                                         const int64_t* __restrict__ pos, T* crit,
                                                         int64_t crit_n, T* def, int64_t def_n) {
  const int slot = threadIdx.x / s.group, lane = threadIdx.x & (s.group - 1);
  const int64_t p0 = pos[0];
  for (int64_t cta = blockIdx.x; cta < s.ctas; cta += gridDim.x) {
    const int64_t q = launch::item_index(s, cta, slot);
    if (q >= s.items) continue;
    const Item it = launch::item_at(s, q);
    const int64_t b = it.row, len = block_len(b, n, bs), hi = launch::item_end(s, it, len);
    const bool sel = mask[b] != 0;
    const int64_t k = before(pos, p0, b);
    T* side = sel ? crit : def;
    if (k < 0 || side == nullptr) continue;
    const int64_t o = (sel ? k : b - k) * bs;  // <= b * bs < n: whole blocks precede b on its side
    if (o + len > (sel ? crit_n : def_n)) continue;
    T* f = flat + b * bs;
    for (int64_t i = it.lo + lane; i < hi; i += s.group) {
      if constexpr (Split) side[o + i] = f[i];
      else f[i] = side[o + i];
    }
  }
}

}  // namespace

void pack_blocks(DType dt, const void* flat, int64_t n, const int64_t* ids, int64_t nids,
                 int64_t bs, int64_t short_pos, void* out, void* stream) {
  const Shape s = launch::plan(nids, launch::min64(n, bs), true);
  if (s.items == 0) return;
  const int64_t last_len = block_len(num_blocks(n, bs) - 1, n, bs);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    gather_kernel<T, true><<<grid_of(s), kThreads, 0, as_stream(stream)>>>(
        s, static_cast<const T*>(flat), static_cast<T*>(out), n, ids, bs, short_pos, last_len, false);
    check_launch("gather_kernel (pack)");
  });
}

void unpack_blocks(DType dt, const void* buf, int64_t n, const int64_t* ids, int64_t nids,
                   int64_t bs, int64_t short_pos, void* flat, bool accumulate, void* stream) {
  const Shape s = launch::plan(nids, launch::min64(n, bs), true);
  if (s.items == 0) return;
  const int64_t last_len = block_len(num_blocks(n, bs) - 1, n, bs);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    gather_kernel<T, false><<<grid_of(s), kThreads, 0, as_stream(stream)>>>(
        s, static_cast<const T*>(buf), static_cast<T*>(flat), n, ids, bs, short_pos, last_len, accumulate);
    check_launch("gather_kernel (unpack)");
  });
}

int64_t check_ids_words(int64_t nblocks) { return 2 + launch::cdiv(nblocks, 64); }

void check_ids(const int64_t* ids, int64_t nids, int64_t nblocks, int64_t* info, void* stream) {
  if (nids == 0) return;
  check_ids_kernel<<<grid_for(nids), kThreads, 0, as_stream(stream)>>>(
      ids, nids, nblocks, reinterpret_cast<unsigned long long*>(info));
  check_launch("check_ids_kernel");
}

void split_blocks(DType dt, const void* flat, int64_t n, const uint8_t* mask, const int64_t* pos,
                  int64_t bs, void* crit, int64_t crit_n, void* def, int64_t def_n, void* stream) {
  const Shape s = launch::shape(n, bs);
  if (s.items == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    split_kernel<T, true><<<grid_of(s), kThreads, 0, as_stream(stream)>>>(
        s, const_cast<T*>(static_cast<const T*>(flat)), n, bs, mask, pos, static_cast<T*>(crit), crit_n,
        static_cast<T*>(def), def_n);
    check_launch("split_kernel (split)");
  });
}

void merge_blocks(DType dt, const void* crit, int64_t crit_n, const void* def, int64_t def_n,
                  const uint8_t* mask, const int64_t* pos, int64_t n, int64_t bs, void* flat,
                  void* stream) {
  const Shape s = launch::shape(n, bs);
  if (s.items == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    split_kernel<T, false><<<grid_of(s), kThreads, 0, as_stream(stream)>>>(
        s, static_cast<T*>(flat), n, bs, mask, pos, const_cast<T*>(static_cast<const T*>(crit)), crit_n,
        const_cast<T*>(static_cast<const T*>(def)), def_n);
    check_launch("split_kernel (merge)");
  });
}

}  // namespace cuda
}  // namespace osp

// Gather and scatter of whole blocks on the GPU: one CTA per listed block (grid-stride).
#include "common_cuda.cuh"

namespace osp {
namespace cuda {
namespace {

// Offset of the k-th listed block in the packed buffer; only the last block of flat is short.
__device__ __forceinline__ int64_t packed_offset(int64_t k, int64_t bs, int64_t short_pos,
                                                 int64_t short_by) {
  return k * bs - ((short_pos >= 0 && k > short_pos) ? short_by : 0);
}

template <typename T>
__global__ void pack_blocks_kernel(const T* __restrict__ flat, int64_t n, const int64_t* __restrict__ ids,
                                   int64_t nids, int64_t bs, int64_t short_pos, int64_t short_by,
                                   T* __restrict__ out) {
  for (int64_t k = blockIdx.x; k < nids; k += gridDim.x) {
    const int64_t b = ids[k], len = block_len(b, n, bs), o = packed_offset(k, bs, short_pos, short_by);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) out[o + i] = flat[b * bs + i];
  }
}

template <typename T>
__global__ void unpack_blocks_kernel(const T* __restrict__ buf, int64_t n, const int64_t* __restrict__ ids,
                                     int64_t nids, int64_t bs, int64_t short_pos, int64_t short_by,
                                     T* __restrict__ flat, bool accumulate) {
  for (int64_t k = blockIdx.x; k < nids; k += gridDim.x) {
    const int64_t b = ids[k], len = block_len(b, n, bs), o = packed_offset(k, bs, short_pos, short_by);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const int64_t j = b * bs + i;
      flat[j] = accumulate ? from_f<T>(to_f(flat[j]) + to_f(buf[o + i])) : buf[o + i];
    }
  }
}

__global__ void check_ids_kernel(const int64_t* __restrict__ ids, int64_t nids, int64_t nb,
                                 int32_t* seen, int32_t* bad) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < nids;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = ids[k];
    if (b < 0 || b >= nb) atomicOr(bad, 1);
    else if (atomicAdd(seen + b, 1) > 0) atomicOr(bad, 2);
  }
}

// Blocks before b on its side start at pos[b] (selected) or b - pos[b] (others) blocks; only the
// last block is short and nothing follows it, so those offsets are whole blocks.
template <typename T>
__global__ void split_blocks_kernel(const T* __restrict__ flat, int64_t n, const uint8_t* __restrict__ mask,
                                    const int64_t* __restrict__ pos, int64_t bs, T* crit, int64_t crit_n,
                                    T* def, int64_t def_n) {
  const int64_t nb = (n + bs - 1) / bs;
  for (int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const bool sel = mask[b] != 0;
    T* dst = sel ? crit : def;
    const int64_t o = (sel ? pos[b] : b - pos[b]) * bs, len = block_len(b, n, bs);
    if (dst == nullptr || o + len > (sel ? crit_n : def_n)) continue;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) dst[o + i] = flat[b * bs + i];
  }
}

template <typename T>
__global__ void merge_blocks_kernel(const T* crit, int64_t crit_n, const T* def, int64_t def_n,
                                    const uint8_t* __restrict__ mask, const int64_t* __restrict__ pos,
                                    int64_t n, int64_t bs, T* __restrict__ flat) {
  const int64_t nb = (n + bs - 1) / bs;
  for (int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const bool sel = mask[b] != 0;
    const T* src = sel ? crit : def;
    const int64_t o = (sel ? pos[b] : b - pos[b]) * bs, len = block_len(b, n, bs);
    if (src == nullptr || o + len > (sel ? crit_n : def_n)) continue;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) flat[b * bs + i] = src[o + i];
  }
}

}  // namespace

void pack_blocks(DType dt, const void* flat, int64_t n, const int64_t* ids, int64_t nids,
                 int64_t bs, int64_t short_pos, void* out, void* stream) {
  if (nids == 0) return;
  const int64_t short_by = num_blocks(n, bs) * bs - n;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    pack_blocks_kernel<T><<<grid_for(nids, 1), kThreads, 0, as_stream(stream)>>>(
        static_cast<const T*>(flat), n, ids, nids, bs, short_pos, short_by, static_cast<T*>(out));
    check_launch("pack_blocks_kernel");
  });
}

void unpack_blocks(DType dt, const void* buf, int64_t n, const int64_t* ids, int64_t nids,
                   int64_t bs, int64_t short_pos, void* flat, bool accumulate, void* stream) {
  if (nids == 0) return;
  const int64_t short_by = num_blocks(n, bs) * bs - n;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    unpack_blocks_kernel<T><<<grid_for(nids, 1), kThreads, 0, as_stream(stream)>>>(
        static_cast<const T*>(buf), n, ids, nids, bs, short_pos, short_by, static_cast<T*>(flat),
        accumulate);
    check_launch("unpack_blocks_kernel");
  });
}

void check_ids(const int64_t* ids, int64_t nids, int64_t nblocks, int32_t* seen, int32_t* bad,
               void* stream) {
  if (nids == 0) return;
  check_ids_kernel<<<grid_for(nids), kThreads, 0, as_stream(stream)>>>(ids, nids, nblocks, seen, bad);
  check_launch("check_ids_kernel");
}

void split_blocks(DType dt, const void* flat, int64_t n, const uint8_t* mask, const int64_t* pos,
                  int64_t bs, void* crit, int64_t crit_n, void* def, int64_t def_n, void* stream) {
  const int64_t nb = num_blocks(n, bs);
  if (nb == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    split_blocks_kernel<T><<<grid_for(nb, 1), kThreads, 0, as_stream(stream)>>>(
        static_cast<const T*>(flat), n, mask, pos, bs, static_cast<T*>(crit), crit_n,
        static_cast<T*>(def), def_n);
    check_launch("split_blocks_kernel");
  });
}

void merge_blocks(DType dt, const void* crit, int64_t crit_n, const void* def, int64_t def_n,
                  const uint8_t* mask, const int64_t* pos, int64_t n, int64_t bs, void* flat,
                  void* stream) {
  const int64_t nb = num_blocks(n, bs);
  if (nb == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    merge_blocks_kernel<T><<<grid_for(nb, 1), kThreads, 0, as_stream(stream)>>>(
        static_cast<const T*>(crit), crit_n, static_cast<const T*>(def), def_n, mask, pos, n, bs,
        static_cast<T*>(flat));
    check_launch("merge_blocks_kernel");
  });
}

}  // namespace cuda
}  // namespace osp

// Gather and scatter of whole blocks: pack/unpack by id list, split/merge by per-block mask.
#include <vector>

#include "common_cpu.h"

namespace osp {
namespace cpu {
namespace {

// offsets[k] = start of the k-th listed block in the packed buffer (only the last block is short).
std::vector<int64_t> packed_offsets(const int64_t* ids, int64_t nids, int64_t n, int64_t bs) {
  std::vector<int64_t> off(nids);
  int64_t o = 0;
  for (int64_t k = 0; k < nids; ++k) { off[k] = o; o += block_len(ids[k], n, bs); }
  return off;
}

template <typename T> OSP_HOT void add_into(T* dst, const T* src, int64_t len) {
  for (int64_t i = 0; i < len; ++i) dst[i] = from_f<T>(to_f(dst[i]) + to_f(src[i]));
}

}  // namespace

void pack_blocks(DType dt, const void* flat, int64_t n, const int64_t* ids, int64_t nids,
                 int64_t bs, void* out) {
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto F = static_cast<const T*>(flat);
    auto O = static_cast<T*>(out);
    const auto off = packed_offsets(ids, nids, n, bs);
    at::parallel_for(0, nids, block_grain(bs), [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k)
        std::memcpy(O + off[k], F + ids[k] * bs, sizeof(T) * block_len(ids[k], n, bs));
    });
  });
}

void unpack_blocks(DType dt, const void* buf, int64_t n, const int64_t* ids, int64_t nids,
                   int64_t bs, void* flat, bool accumulate) {
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto B = static_cast<const T*>(buf);
    auto F = static_cast<T*>(flat);
    const auto off = packed_offsets(ids, nids, n, bs);
    at::parallel_for(0, nids, block_grain(bs), [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t len = block_len(ids[k], n, bs);
        if (accumulate) add_into(F + ids[k] * bs, B + off[k], len);
        else std::memcpy(F + ids[k] * bs, B + off[k], sizeof(T) * len);
      }
    });
  });
}

void split_blocks(DType dt, const void* flat, int64_t n, const uint8_t* mask, int64_t bs,
                  void* crit, void* def) {
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto F = static_cast<const T*>(flat);
    const auto pos = side_offsets(mask, n, bs);
    at::parallel_for(0, num_blocks(n, bs), block_grain(bs), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        T* dst = static_cast<T*>(mask[b] ? crit : def);
        if (dst) std::memcpy(dst + pos[b], F + b * bs, sizeof(T) * block_len(b, n, bs));
      }
    });
  });
}

void merge_blocks(DType dt, const void* crit, const void* def, const uint8_t* mask, int64_t n,
                  int64_t bs, void* flat) {
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    auto F = static_cast<T*>(flat);
    const auto pos = side_offsets(mask, n, bs);
    at::parallel_for(0, num_blocks(n, bs), block_grain(bs), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T* src = static_cast<const T*>(mask[b] ? crit : def);
        if (src) std::memcpy(F + b * bs, src + pos[b], sizeof(T) * block_len(b, n, bs));
      }
    });
  });
}

}  // namespace cpu
}  // namespace osp

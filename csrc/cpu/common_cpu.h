// Shared pieces of the CPU kernels: dtype dispatch, fp32 conversion, rounding and block geometry.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "../ops.h"

// Hot loops get an AVX2+FMA clone on x86-64 (picked at load time) and a portable default; both
// compute the same bits, since the code spells out every fused multiply-add it does (std::fma) and
// the build forbids the compiler from contracting others (-ffp-contract=off).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OSP_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define OSP_HOT
#endif

namespace osp {
namespace cpu {

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }
// bf16 <-> fp32 spelled out without branches (same bits as c10's conversions) so loops vectorize.
template <> inline float to_f<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline c10::BFloat16 bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t r = static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
  return c10::BFloat16(f != f ? uint16_t(0x7FC0) : r, c10::BFloat16::from_bits());
}
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }
template <> inline c10::BFloat16 from_f<c10::BFloat16>(float x) { return bf16_rne(x); }
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
// fp16 through the compiler's _Float16: F16C instructions in the x86-64-v3 clone (c10's software
// conversion is ~30x slower); IEEE round-to-nearest-even either way, so the same bits.
template <> inline float to_f<c10::Half>(c10::Half x) {
  _Float16 h;
  std::memcpy(&h, &x.x, sizeof h);
  return static_cast<float>(h);
}
template <> inline c10::Half from_f<c10::Half>(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return c10::Half(bits, c10::Half::from_bits());
}
#endif
// Round an fp32 value to T and back: where torch.optim materialises a tensor of dtype T.
template <typename T> inline float rnd(float x) { return to_f(from_f<T>(x)); }
template <> inline float rnd<float>(float x) { return x; }

template <typename F> void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f(float{}); break;
    case DType::F16: f(c10::Half{}); break;
    case DType::BF16: f(c10::BFloat16{}); break;
  }
}

inline int64_t block_len(int64_t b, int64_t n, int64_t bs) { return std::min(bs, n - b * bs); }

// Blocks per parallel task: about 64K elements, at least one block.
inline int64_t block_grain(int64_t bs) { return std::max<int64_t>(1, (int64_t(1) << 16) / bs); }

// pos[b] = offset of block b inside its side's packed buffer (mask != 0: the selected blocks' buffer,
// otherwise the others'), each side in ascending block order.
inline std::vector<int64_t> side_offsets(const uint8_t* mask, int64_t n, int64_t bs) {
  const int64_t nb = num_blocks(n, bs);
  std::vector<int64_t> pos(nb);
  int64_t oc = 0, od = 0;
  for (int64_t b = 0; b < nb; ++b) {
    int64_t& o = mask[b] ? oc : od;
    pos[b] = o;
    o += block_len(b, n, bs);
  }
  return pos;
}

}  // namespace cpu
}  // namespace osp

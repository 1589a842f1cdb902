// Launch shapes of osp's CUDA kernels over blocks. Plain C++ with no CUDA or torch header, so the CPU
// extension exposes the very same arithmetic for tests without a GPU (torch.ops.osp.launch_shape,
// launch_items, launch_cover in bindings.cpp); under nvcc the item mapping is also device code.
//
// A kernel over R rows (blocks, or listed blocks) of at most `span` elements runs items: an item is
// one chunk of one row, processed by a group of `group` threads (a power of two). Long rows
// (span > kChunk) are cut into chunks of kChunk elements, each item a whole CTA; short rows are one
// chunk each, and one CTA runs kThreads / group of them side by side (bs = 1: a thread per block).
// CTA w runs items w * per_cta + slot (slot = thread / group); a capped grid strides over the CTAs, so
// any size works and every item, so every element, is visited exactly once. Nothing here depends on
// the GPU, so a score's reduction order, and with it its bits, is the same on every rank.
//
// All counts are computed from the host's num_blocks (ops.h, overflow-safe) and int64 throughout: a
// row offset b * bs is formed only for an existing block b (so it is < n), and chunk counts come from
// span = min(bs, n), never from bs itself, so bs = 2**63 - 1 is one block like any other.
#pragma once
#include <cstdint>

#include "ops.h"

#if defined(__CUDACC__)
#define OSP_HD __host__ __device__ __forceinline__
#else
#define OSP_HD inline
#endif

namespace osp {
namespace launch {

constexpr int kThreads = 256;                                // threads per CTA
constexpr int kPerThread = 16;                               // elements per thread in a full chunk
constexpr int64_t kChunk = int64_t(kThreads) * kPerThread;   // a long row's chunk: 4096 elements
constexpr int64_t kMaxGrid = int64_t(1) << 20;               // CTAs launched at most (grid stride)

OSP_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
// ceil(a / b) for a >= 0, b > 0, without the a + b - 1 that wraps
OSP_HD int64_t cdiv(int64_t a, int64_t b) { return a == 0 ? 0 : (a - 1) / b + 1; }
// Length of block b (an existing one: b < num_blocks(n, bs), so b * bs < n)
OSP_HD int64_t block_len(int64_t b, int64_t n, int64_t bs) { return min64(bs, n - b * bs); }

struct Shape {
  int64_t rows;     // rows (blocks)
  int64_t span;     // the longest row's length
  int64_t chunk;    // elements per item
  int64_t chunks;   // items (chunks) per row
  int64_t items;    // rows * chunks
  int64_t ctas;     // CTAs the items need: ceil(items / per_cta)
  int64_t grid;     // CTAs launched: min(ctas, kMaxGrid); each strides over ctas by grid
  int32_t group;    // threads per item: a power of two, kThreads when a row has several chunks
  int32_t per_cta;  // items per CTA: kThreads / group
};

// rows of at most span elements; split: long rows may be cut into chunks (false: one item per row,
// whatever its length; its group's threads stride over it).
inline Shape plan(int64_t rows, int64_t span, bool split) {
  Shape s{rows, span, 0, 0, 0, 0, 0, kThreads, 1};
  if (rows <= 0 || span <= 0) {
    s.rows = s.span = 0;
    return s;
  }
  if (split && span > kChunk) {
    s.chunk = kChunk;
    s.chunks = cdiv(span, kChunk);
  } else {
    const int64_t want = cdiv(span, kPerThread);
    int32_t g = 1;
    while (g < want && g < kThreads) g <<= 1;
    s.group = g;
    s.per_cta = kThreads / g;
    s.chunk = span;
    s.chunks = 1;
  }
  s.items = rows * s.chunks;  // <= rows + n / kChunk: no overflow for any n that fits in memory
  s.ctas = cdiv(s.items, s.per_cta);
  s.grid = min64(s.ctas, kMaxGrid);
  return s;
}

// The blocks of a flat tensor of n elements, in blocks of bs.
inline Shape shape(int64_t n, int64_t bs) { return plan(num_blocks(n, bs), min64(n, bs), true); }

// Item q: chunk `chunk` of row `row`, elements [lo, min(lo + chunk, row length)) of the row.
struct Item {
  int64_t row, chunk, lo;
};
OSP_HD int64_t item_index(const Shape& s, int64_t cta, int slot) { return cta * s.per_cta + slot; }
OSP_HD Item item_at(const Shape& s, int64_t q) {
  const int64_t r = s.chunks == 1 ? q : q / s.chunks, c = q - r * s.chunks;
  return {r, c, c * s.chunk};
}
OSP_HD int64_t item_end(const Shape& s, const Item& it, int64_t len) { return min64(it.lo + s.chunk, len); }

// score_blocks: one pass when every block is one chunk (pass 1 writes the scores); otherwise pass 1
// writes each (block, chunk) partial to workspace[item] (a block's partials are contiguous) and pass 2
// folds each block's `pass1.chunks` partials, one item per block. Each item folds its elements in a
// fixed tree (per thread in index order, then across the group), so the order depends on (n, bs) only.
struct ScorePlan {
  Shape pass1, pass2;
  int64_t workspace;  // floats of workspace: 0 for one pass
};
inline ScorePlan score_plan(int64_t n, int64_t bs) {
  ScorePlan p{shape(n, bs), plan(0, 0, false), 0};
  if (p.pass1.chunks > 1) {
    p.workspace = p.pass1.items;
    p.pass2 = plan(p.pass1.rows, p.pass1.chunks, false);
  }
  return p;
}

}  // namespace launch
}  // namespace osp
